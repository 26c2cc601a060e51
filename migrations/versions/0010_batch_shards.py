"""The batch queue shard of each job (rein.jobs.affinity), and the batch manager's index of a
batch's unsent lines by shard, then prefix order.

`ADD COLUMN ... DEFAULT 0` with a constant default rewrites no rows (Postgres 11+): jobs that
exist keep shard 0, the plain batch queue's name.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNSENT = sa.text("status = 'queued' AND sent_at IS NULL")


def upgrade() -> None:
    op.add_column("jobs", sa.Column("shard", sa.SmallInteger(), server_default=sa.text("0"), nullable=False))
    op.drop_index("ix_jobs_batch_unsent", table_name="jobs")
    op.create_index("ix_jobs_batch_unsent", "jobs", ["batch_id", "shard", "feed_key", "batch_line"],
                    postgresql_where=UNSENT)


def downgrade() -> None:
    op.drop_index("ix_jobs_batch_unsent", table_name="jobs")
    op.create_index("ix_jobs_batch_unsent", "jobs", ["batch_id", "feed_key", "batch_line"], postgresql_where=UNSENT)
    op.drop_column("jobs", "shard")
