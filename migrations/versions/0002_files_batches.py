"""Files and batches: the files and batches tables; jobs gain batch_id, custom_id, batch_line, sent_at.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NOW = sa.text("now()")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("purpose", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", TS, server_default=NOW, nullable=False),
        sa.CheckConstraint("purpose IN ('batch', 'batch_output')", name="ck_files_purpose_valid"),
        sa.CheckConstraint("bytes >= 0", name="ck_files_bytes_nonnegative"),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.key_id"], name="fk_files_key_id_api_keys"),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
    )
    op.create_index("ix_files_tenant_created_at", "files", ["tenant", "created_at", "id"])

    op.create_table(
        "batches",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("input_file_id", sa.Text(), nullable=False),
        sa.Column("completion_window", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("status", sa.Text(), server_default=sa.text("'validating'"), nullable=False),
        sa.Column("request_total", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("errors", JSONB(), nullable=True),
        sa.Column("metadata", JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("output_file_id", sa.Text(), nullable=True),
        sa.Column("error_file_id", sa.Text(), nullable=True),
        sa.Column("created_at", TS, server_default=NOW, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.Column("in_progress_at", TS, nullable=True),
        sa.Column("finalizing_at", TS, nullable=True),
        sa.Column("completed_at", TS, nullable=True),
        sa.Column("failed_at", TS, nullable=True),
        sa.Column("expired_at", TS, nullable=True),
        sa.Column("cancelling_at", TS, nullable=True),
        sa.Column("cancelled_at", TS, nullable=True),
        sa.CheckConstraint("status IN ('validating', 'failed', 'in_progress', 'finalizing', 'completed', "
                           "'expired', 'cancelling', 'cancelled')", name="ck_batches_status_valid"),
        sa.CheckConstraint("request_total >= 0", name="ck_batches_request_total_nonnegative"),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.key_id"], name="fk_batches_key_id_api_keys"),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
    )
    op.create_index("ix_batches_tenant_created_at", "batches", ["tenant", "created_at", "id"])
    op.create_index("ix_batches_status", "batches", ["status"])

    op.add_column("jobs", sa.Column("batch_id", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("custom_id", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("batch_line", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("sent_at", TS, nullable=True))
    op.create_foreign_key("fk_jobs_batch_id_batches", "jobs", "batches", ["batch_id"], ["id"])
    op.create_unique_constraint("uq_jobs_batch_id_custom_id", "jobs", ["batch_id", "custom_id"])
    op.create_index("ix_jobs_batch_id_status", "jobs", ["batch_id", "status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_batch_id_status", table_name="jobs")
    op.drop_constraint("uq_jobs_batch_id_custom_id", "jobs", type_="unique")
    op.drop_constraint("fk_jobs_batch_id_batches", "jobs", type_="foreignkey")
    for column in ("sent_at", "batch_line", "custom_id", "batch_id"):
        op.drop_column("jobs", column)
    op.drop_table("batches")
    op.drop_table("files")
