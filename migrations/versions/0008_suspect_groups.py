"""jobs.suspect_group and jobs.suspect_group_size: which jobs a suspect of an engine death may
share an engine with.

When an engine dies under a live worker, the jobs present are split in halves; each is handed
back as a suspect of its half (`suspect_group`, a half of `suspect_group_size` jobs), runs only
beside jobs that are no suspects and its own group (alone when the group is itself), and is
failed as the cause only once it died alone after an earlier death (rein.worker.suspects).
Both are NULL for a job that no engine died under. `deaths_seen` now counts engine deaths only:
a worker that vanished whole is no evidence against the jobs it held.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("suspect_group", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("suspect_group_size", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "suspect_group_size")
    op.drop_column("jobs", "suspect_group")
