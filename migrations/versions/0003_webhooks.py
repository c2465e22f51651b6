"""webhooks: jobs.webhook_url, api_keys.webhook_secret, webhook_deliveries

Revision ID: 0003_webhooks
Revises: 0002_worker_faults
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_webhooks"
down_revision: str | None = "0002_worker_faults"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("webhook_secret", sa.String(length=64), nullable=True))
    op.add_column("jobs", sa.Column("webhook_url", sa.Text(), nullable=True))
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("event", sa.String(length=32), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("attempt_log", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_webhook_deliveries_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
        sa.UniqueConstraint("job_id", "event", name=op.f("uq_webhook_deliveries_job_id_event")),
    )
    op.create_index(
        op.f("ix_webhook_deliveries_job_id"), "webhook_deliveries", ["job_id"], unique=False
    )
    op.create_index(
        "ix_webhook_deliveries_state_next",
        "webhook_deliveries",
        ["state", "next_attempt_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_state_next", table_name="webhook_deliveries")
    op.drop_index(op.f("ix_webhook_deliveries_job_id"), table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("webhook_url")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("webhook_secret")
