"""Files may be uploaded with purpose "vision": images a chat or Responses request names by file id
(rein.jobs.image_sources).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_constraint("ck_files_purpose_valid", "files", type_="check")
    op.create_check_constraint("purpose_valid", "files", "purpose IN ('batch', 'batch_output', 'vision')")


def downgrade() -> None:
    op.execute("DELETE FROM files WHERE purpose = 'vision'")
    op.drop_constraint("ck_files_purpose_valid", "files", type_="check")
    op.create_check_constraint("purpose_valid", "files", "purpose IN ('batch', 'batch_output')")
