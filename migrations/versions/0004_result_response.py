"""results.response: the parts of a response body the worker built beyond one plain choice.

`choices` when a request has n > 1, echo, prompt logprobs or tool calls; `data` for an
embeddings request. NULL for a plain single-choice answer (built from the other columns).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("results", sa.Column("response", JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("results", "response")
