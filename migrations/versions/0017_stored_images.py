"""stored_images: the images requests sent, kept in the file store by sha256 until their jobs have
run; the retention sweep deletes the unused ones (rein.jobs.image_sources, rein.jobs.retention).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NOW = sa.text("now()")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "stored_images",
        sa.Column("sha256", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", TS, server_default=NOW, nullable=False),
        sa.Column("last_used_at", TS, server_default=NOW, nullable=False),
        sa.CheckConstraint("bytes >= 0", name="ck_stored_images_bytes_nonnegative"),
        sa.PrimaryKeyConstraint("sha256", name="pk_stored_images"),
    )
    op.create_index("ix_stored_images_last_used_at", "stored_images", ["last_used_at"])


def downgrade() -> None:
    op.drop_index("ix_stored_images_last_used_at", table_name="stored_images")
    op.drop_table("stored_images")
