"""local_models: model names the workers (or an operator) registered for the API to accept

Revision ID: 0005_local_models
Revises: 0004_artifact_store
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_local_models"
down_revision: str | None = "0004_artifact_store"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "local_models",
        sa.Column("name", sa.String(length=96), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("name", "holder"),
    )


def downgrade() -> None:
    op.drop_table("local_models")
