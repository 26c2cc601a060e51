"""jobs.attempts_refunded and jobs.deaths_seen: attempts the infrastructure spent, not the job.

An attempt handed back because its worker, its engine, Redis or Postgres failed (not because
the job did) is refunded: `attempt` still counts every claim (it is the lease's fencing
token, so it never goes down), and a job may start again while `attempt - attempts_refunded`
is under the limit. `deaths_seen` counts the deaths of its engine or worker a job was present
at: such a job runs alone next time, and one present at several is failed as the likely cause.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("attempts_refunded", sa.Integer(), server_default=sa.text("0"), nullable=False))
    op.add_column("jobs", sa.Column("deaths_seen", sa.Integer(), server_default=sa.text("0"), nullable=False))


def downgrade() -> None:
    op.drop_column("jobs", "deaths_seen")
    op.drop_column("jobs", "attempts_refunded")
