"""Per-key Hub tokens and scratch accounting: api_keys.hub_token (the key's Hugging Face token,
encrypted with the service's HIGGS_HUB_TOKEN_SECRET; never stored in the clear) with the time
it was set, jobs.scratch_bytes (the running attempt's scratch on the worker's disk, counted in
the key's disk quota) and jobs.scratch_reclaimed_bytes (scratch of the job's dead attempts the
worker removed)

Revision ID: 0010_key_hub_token_scratch
Revises: 0009_gguf
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_key_hub_token_scratch"
down_revision: str | None = "0009_gguf"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("hub_token", sa.Text(), nullable=True))
        batch.add_column(sa.Column("hub_token_set_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("scratch_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("scratch_reclaimed_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN (SQLite 3.35+ has it): a batch copy of api_keys would
    # drop the table that jobs and calibrations point at.
    op.drop_column("jobs", "scratch_reclaimed_bytes")
    op.drop_column("jobs", "scratch_bytes")
    op.drop_column("api_keys", "hub_token_set_at")
    op.drop_column("api_keys", "hub_token")
