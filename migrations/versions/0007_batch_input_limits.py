"""Batch input limits: batches.validation_starts and jobs.requested_tokens.

`batches.validation_starts` counts the validations of a batch started and not ended by their
process: the batch manager adds one (committed) before it reads the file and takes it back when
it stops without a verdict, so a batch whose validation kills its process (out of memory) is
failed after a few deaths instead of killing every replica in turn until its deadline.

`jobs.requested_tokens` is a batch line's prompt + n x max_tokens, written by the COPY, and a
partial index over the batch lines sent and not finished: the manager sums them per tenant to
hold a tenant's further lines back at REIN_MAX_QUEUED_BATCH_TOKENS_PER_TENANT. Lines copied
before this revision have none and count their prompt tokens.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("validation_starts", sa.Integer(), server_default=sa.text("0"),
                                       nullable=False))
    op.add_column("jobs", sa.Column("requested_tokens", sa.Integer(), nullable=True))
    op.create_index("ix_jobs_batch_in_flight", "jobs", ["tenant"],
                    postgresql_where=sa.text("batch_id IS NOT NULL AND sent_at IS NOT NULL "
                                             "AND status IN ('queued', 'running')"))


def downgrade() -> None:
    op.drop_index("ix_jobs_batch_in_flight", table_name="jobs")
    op.drop_column("jobs", "requested_tokens")
    op.drop_column("batches", "validation_starts")
