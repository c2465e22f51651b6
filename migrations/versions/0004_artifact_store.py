"""artifacts.root (an absolute path) becomes artifacts.uri (a store URI: file:// or s3://)

Revision ID: 0004_artifact_store
Revises: 0003_webhooks
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath
from urllib.parse import quote, unquote, urlparse

import sqlalchemy as sa
from alembic import op

revision: str = "0004_artifact_store"
down_revision: str | None = "0003_webhooks"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_artifacts = sa.table(
    "artifacts", sa.column("id", sa.Integer), sa.column("uri", sa.Text), sa.column("root", sa.Text)
)


def path_to_uri(path: str) -> str:
    """file:// URI of an absolute POSIX path (as pathlib's as_uri writes it)."""
    return PurePosixPath(path).as_uri() if path.startswith("/") else "file://" + quote(path)


def uri_to_path(uri: str) -> str:
    u = urlparse(uri)
    return unquote(u.path) if u.scheme == "file" else uri


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("uri", sa.Text(), nullable=True))
    conn = op.get_bind()
    for row_id, root in conn.execute(sa.select(_artifacts.c.id, _artifacts.c.root)).all():
        conn.execute(
            _artifacts.update().where(_artifacts.c.id == row_id).values(uri=path_to_uri(root))
        )
    with op.batch_alter_table("artifacts") as batch:
        batch.alter_column("uri", existing_type=sa.Text(), nullable=False)
        batch.drop_column("root")


def downgrade() -> None:
    # Rows in an S3 store have no path: they keep their URI (the old code cannot serve them).
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("root", sa.Text(), nullable=True))
    conn = op.get_bind()
    for row_id, uri in conn.execute(sa.select(_artifacts.c.id, _artifacts.c.uri)).all():
        conn.execute(
            _artifacts.update().where(_artifacts.c.id == row_id).values(root=uri_to_path(uri))
        )
    with op.batch_alter_table("artifacts") as batch:
        batch.alter_column("root", existing_type=sa.Text(), nullable=False)
        batch.drop_column("uri")
