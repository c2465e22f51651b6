"""Throwaway PostgreSQL databases for the tests and the service benchmark (CREATE DATABASE and
DROP DATABASE on a server the caller names: development only, never part of the service)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from sqlalchemy import text
from sqlalchemy.engine import make_url

from app.db.session import create_db_engine, normalise_url


def scratch_postgres(
    server_url: str, prefix: str = "higgs_scratch"
) -> tuple[str, Callable[[], None]]:
    """CREATE DATABASE <prefix>_<random> on the server of `server_url` (empty: migrate it
    with `alembic upgrade head`). Returns its URL and a function that drops it."""
    admin_url = make_url(normalise_url(server_url))
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_db_engine(
        admin_url.render_as_string(hide_password=False), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return admin_url.set(database=name).render_as_string(hide_password=False), drop
