"""job_parts.output: a finished part's metadata (its shard files with bytes and sha256, tensor
names, layer rows), from which the assembly writes the artifacts' small files without reading
any shard

Revision ID: 0008_part_output
Revises: 0007_job_parts
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_part_output"
down_revision: str | None = "0007_job_parts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_parts") as batch:
        batch.add_column(sa.Column("output", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_parts") as batch:
        batch.drop_column("output")
