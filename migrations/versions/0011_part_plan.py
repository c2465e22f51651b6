"""job_parts.plan: the job plan (higgs_engine.job.JobPlan.to_dict(): kind, config with a
dynamic plan's per-layer grids, parts, device, threads, source, the profile and allocation the
report's annotations come from) the coordinator made once; every part and the assembly run it

Revision ID: 0011_part_plan
Revises: 0010_key_hub_token_scratch
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_part_plan"
down_revision: str | None = "0010_key_hub_token_scratch"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_parts") as batch:
        batch.add_column(sa.Column("plan", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_parts") as batch:
        batch.drop_column("plan")
