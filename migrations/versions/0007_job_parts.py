"""job_parts: one job fanned out over many workers, one row per part (shards of the source)

Revision ID: 0007_job_parts
Revises: 0006_calibrations
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_job_parts"
down_revision: str | None = "0006_calibrations"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_parts",
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("job_attempt", sa.Integer(), nullable=False),
        sa.Column("shards", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("engine_config", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("worker_id", sa.String(length=255), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("progress_done", sa.Integer(), nullable=False),
        sa.Column("progress_total", sa.Integer(), nullable=False),
        sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("output_uri", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_parts_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "idx", name=op.f("pk_job_parts")),
    )
    op.create_index(
        "ix_job_parts_state_heartbeat", "job_parts", ["state", "heartbeat_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_job_parts_state_heartbeat", table_name="job_parts")
    op.drop_table("job_parts")
