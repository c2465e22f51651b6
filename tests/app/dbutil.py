"""Databases for tests, always built by the Alembic migrations (never create_all).

SQLite: a migrated template file copied per test. PostgreSQL: a fresh database per test
session on the server named by HIGGS_TEST_POSTGRES_URL, emptied between tests.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import make_url

from app.db.base import Base
from app.db.migrate import upgrade_database
from app.db.session import create_db_engine, normalise_url

POSTGRES_ENV = "HIGGS_TEST_POSTGRES_URL"
POSTGRES_SKIP_REASON = (
    f"{POSTGRES_ENV} is not set (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/postgres)"
)


def postgres_server_url() -> str | None:
    return os.environ.get(POSTGRES_ENV) or None


def migrated_sqlite_template(folder: Path) -> Path:
    path = folder / "template.db"
    upgrade_database(f"sqlite:///{path}")
    return path


def sqlite_copy(template: Path, dest: Path) -> str:
    shutil.copyfile(template, dest)
    return f"sqlite:///{dest}"


@contextmanager
def fresh_postgres_database(server_url: str) -> Iterator[str]:
    """CREATE DATABASE higgs_test_<random> on the server, migrate it, yield its URL, DROP it."""
    admin_url = make_url(normalise_url(server_url))
    name = f"higgs_test_{uuid.uuid4().hex[:12]}"
    admin = create_db_engine(
        admin_url.render_as_string(hide_password=False), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = admin_url.set(database=name).render_as_string(hide_password=False)
    try:
        upgrade_database(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def empty_postgres(url: str) -> None:
    engine = create_db_engine(url)
    try:
        with engine.begin() as conn:
            names = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
            conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
    finally:
        engine.dispose()
