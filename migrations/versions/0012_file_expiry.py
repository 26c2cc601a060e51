"""File expiry: `files.expires_at` (OpenAI's `expires_at`; null: kept until deleted) with a
partial index for the sweep (rein.jobs.retention), and `batches.output_expires_after_seconds`,
the expiry a batch's output and error files get when they are written (its
`output_expires_after`, else REIN_BATCH_FILE_EXPIRY_SECONDS when it was created).

Rows from before this revision keep what they had: output and error files expire 30 days
after they were written (REIN_OUTPUT_FILE_RETENTION_DAYS' default, which this replaces), a
batch still running writes its files with that expiry too, and earlier uploads never expire.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEGACY_OUTPUT_SECONDS = 30 * 86_400


def upgrade() -> None:
    op.add_column("files", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_files_expires_at", "files", ["expires_at"],
                    postgresql_where=sa.text("expires_at IS NOT NULL"))
    op.add_column("batches", sa.Column("output_expires_after_seconds", sa.Integer(), nullable=True))
    op.execute(sa.text("UPDATE files SET expires_at = created_at + make_interval(secs => :seconds) "
                       "WHERE purpose = 'batch_output'").bindparams(seconds=LEGACY_OUTPUT_SECONDS))
    op.execute(sa.text("UPDATE batches SET output_expires_after_seconds = :seconds "
                       "WHERE status IN ('validating', 'in_progress', 'finalizing', 'cancelling')")
               .bindparams(seconds=LEGACY_OUTPUT_SECONDS))
    op.drop_index("ix_files_output_created_at", table_name="files")


def downgrade() -> None:
    op.create_index("ix_files_output_created_at", "files", ["created_at"],
                    postgresql_where=sa.text("purpose = 'batch_output'"))
    op.drop_column("batches", "output_expires_after_seconds")
    op.drop_index("ix_files_expires_at", table_name="files")
    op.drop_column("files", "expires_at")
