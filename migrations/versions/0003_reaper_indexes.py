"""Partial indexes for the reaper: running jobs by lease expiry, queued jobs by model, priority
and sent_at (rein.worker.reaper).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_running_lease", "jobs", ["lease_expires_at"],
                    postgresql_where=sa.text("status = 'running'"))
    op.create_index("ix_jobs_queued_sent", "jobs", ["model", "priority", "sent_at"],
                    postgresql_where=sa.text("status = 'queued'"))


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_sent", table_name="jobs")
    op.drop_index("ix_jobs_running_lease", table_name="jobs")
