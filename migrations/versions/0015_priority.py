"""The batch manager's index of a batch's unsent lines by shard, then priority (a line's own
`priority`, rein.core.priorities), then prefix order: the batch sends its better lines first.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNSENT = sa.text("status = 'queued' AND sent_at IS NULL")


def upgrade() -> None:
    op.drop_index("ix_jobs_batch_unsent", table_name="jobs")
    op.create_index("ix_jobs_batch_unsent", "jobs", ["batch_id", "shard", "priority", "feed_key", "batch_line"],
                    postgresql_where=UNSENT)


def downgrade() -> None:
    op.drop_index("ix_jobs_batch_unsent", table_name="jobs")
    op.create_index("ix_jobs_batch_unsent", "jobs", ["batch_id", "shard", "feed_key", "batch_line"],
                    postgresql_where=UNSENT)
