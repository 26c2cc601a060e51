"""Initial schema: api_keys, jobs, results, usage.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NOW = sa.text("now()")


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("secret_hash", sa.LargeBinary(), nullable=False),
        sa.Column("scopes", ARRAY(sa.Text()), nullable=False),
        sa.Column("rpm_limit", sa.Integer(), nullable=True),
        sa.Column("tpm_limit", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("rpm_limit IS NULL OR rpm_limit > 0", name="ck_api_keys_rpm_limit_positive"),
        sa.CheckConstraint("tpm_limit IS NULL OR tpm_limit > 0", name="ck_api_keys_tpm_limit_positive"),
        sa.PrimaryKeyConstraint("key_id", name="pk_api_keys"),
    )
    op.create_index("ix_api_keys_tenant", "api_keys", ["tenant"])

    op.create_table(
        "jobs",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("params", JSONB(), nullable=False),
        sa.Column("prompt_token_ids", ARRAY(sa.Integer()), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("priority", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("status", sa.Text(), server_default=sa.text("'queued'"), nullable=False),
        sa.Column("attempt", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("worker", sa.Text(), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("metadata", JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.Column("queued_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("first_token_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", JSONB(), nullable=True),
        sa.CheckConstraint("status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
                           name="ck_jobs_status_valid"),
        sa.CheckConstraint("attempt >= 0", name="ck_jobs_attempt_nonnegative"),
        sa.CheckConstraint("prompt_tokens >= 0", name="ck_jobs_prompt_tokens_nonnegative"),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.key_id"], name="fk_jobs_key_id_api_keys"),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
        sa.UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
    )
    op.create_index("ix_jobs_key_id", "jobs", ["key_id"])
    op.create_index("ix_jobs_tenant_created_at", "jobs", ["tenant", "created_at", "id"])

    op.create_table(
        "results",
        sa.Column("job_id", sa.Text(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("finish_reason", sa.Text(), nullable=False),
        sa.Column("token_ids", ARRAY(sa.Integer()), nullable=False),
        sa.Column("logprobs", JSONB(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_results_job_id_jobs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", name="pk_results"),
    )

    op.create_table(
        "usage",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.CheckConstraint("prompt_tokens >= 0 AND completion_tokens >= 0 AND cached_tokens >= 0 "
                           "AND cached_tokens <= prompt_tokens", name="ck_usage_tokens_valid"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_usage_job_id_jobs", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.key_id"], name="fk_usage_key_id_api_keys"),
        sa.PrimaryKeyConstraint("id", name="pk_usage"),
        sa.UniqueConstraint("job_id", name="uq_usage_job_id"),
    )
    op.create_index("ix_usage_tenant_created_at", "usage", ["tenant", "created_at"])


def downgrade() -> None:
    op.drop_table("usage")
    op.drop_table("results")
    op.drop_table("jobs")
    op.drop_table("api_keys")
