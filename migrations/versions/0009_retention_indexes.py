"""Indexes for retention (rein.jobs.retention): results and usage rows by age, and batch output
and error files by age, so each retention batch reads the oldest rows from an index instead of
scanning the table (and a pass that finds nothing past its retention costs one index probe).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_results_created_at", "results", ["created_at"])
    op.create_index("ix_usage_created_at", "usage", ["created_at"])
    op.create_index("ix_files_output_created_at", "files", ["created_at"],
                    postgresql_where=sa.text("purpose = 'batch_output'"))


def downgrade() -> None:
    op.drop_index("ix_files_output_created_at", table_name="files")
    op.drop_index("ix_usage_created_at", table_name="usage")
    op.drop_index("ix_results_created_at", table_name="results")
