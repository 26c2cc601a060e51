"""jobs.feed_key: the batch manager sends a batch's lines in prefix order.

A batch line's prompt prefix (its first 128 token ids as big-endian uint32 bytes, which sort
as the token lists do), written as the lines are copied in, and a partial index over the
lines not sent yet, so the manager's next lines are an index range however far the batch has
got. Lines of batches copied before this revision have none and go in the file's order.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("feed_key", sa.LargeBinary(), nullable=True))
    op.create_index("ix_jobs_batch_unsent", "jobs", ["batch_id", "feed_key", "batch_line"],
                    postgresql_where=sa.text("status = 'queued' AND sent_at IS NULL"))


def downgrade() -> None:
    op.drop_index("ix_jobs_batch_unsent", table_name="jobs")
    op.drop_column("jobs", "feed_key")
