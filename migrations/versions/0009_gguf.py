"""GGUF: local_models.architecture (the first `architectures` entry of a registered model's
config.json, so that the API refuses gguf for an architecture llama.cpp's converter does not
know at submit) and job_layers.type (the llama.cpp tensor type of a GGUF job's tensor)

Revision ID: 0009_gguf
Revises: 0008_part_output
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_gguf"
down_revision: str | None = "0008_part_output"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("local_models") as batch:
        batch.add_column(sa.Column("architecture", sa.String(128), nullable=True))
    with op.batch_alter_table("job_layers") as batch:
        batch.add_column(sa.Column("type", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_layers") as batch:
        batch.drop_column("type")
    with op.batch_alter_table("local_models") as batch:
        batch.drop_column("architecture")
