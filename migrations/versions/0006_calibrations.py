"""calibrations: calibration text uploaded per API key for calibrated HIGGS jobs

Revision ID: 0006_calibrations
Revises: 0005_local_models
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_calibrations"
down_revision: str | None = "0005_local_models"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "calibrations",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("api_key_id", sa.String(length=36), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["api_key_id"], ["api_keys.id"], name=op.f("fk_calibrations_api_key_id_api_keys")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibrations")),
    )
    op.create_index(
        op.f("ix_calibrations_api_key_id"), "calibrations", ["api_key_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_calibrations_api_key_id"), table_name="calibrations")
    op.drop_table("calibrations")
