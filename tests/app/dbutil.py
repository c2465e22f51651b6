"""Databases for tests, always built by the Alembic migrations (never create_all).

SQLite: a migrated template file copied per test. PostgreSQL: a fresh database per test
session on the server named by HIGGS_TEST_POSTGRES_URL, emptied between tests.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import text

from app.db.base import Base
from app.db.migrate import upgrade_database
from app.db.session import create_db_engine
from devtools.scratch import scratch_postgres

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
    """A scratch database higgs_test_<random> on the server, migrated; dropped afterwards."""
    url, drop = scratch_postgres(server_url, "higgs_test")
    try:
        upgrade_database(url)
        yield url
    finally:
        drop()


def empty_postgres(url: str) -> None:
    engine = create_db_engine(url)
    try:
        with engine.begin() as conn:
            names = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
            conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
    finally:
        engine.dispose()
