"""usage.reasoning_tokens: the thinking's share of a job's completion tokens (reasoning models,
rein.openai.reasoning), summed into a batch's usage.output_tokens_details.reasoning_tokens.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("usage", sa.Column("reasoning_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False))


def downgrade() -> None:
    op.drop_column("usage", "reasoning_tokens")
