"""LoRA adapters registered at run time (POST /v1/load_lora_adapter), known to every API
process and worker of the fleet (rein.jobs.adapters).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "lora_adapters",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("base_model", sa.Text(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("lora_int_id", sa.BigInteger(), nullable=False),
        sa.Column("base_model_name", sa.Text(), nullable=True),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.key_id"], name="fk_lora_adapters_key_id_api_keys"),
        sa.PrimaryKeyConstraint("name", name="pk_lora_adapters"),
    )


def downgrade() -> None:
    op.drop_table("lora_adapters")
