"""Alembic is the only way the schema is made: the migrations build exactly the models'
schema, downgrade cleanly, and the `alembic` command line works with -x url=..."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from app.db.base import Base
from app.db.migrate import downgrade_database, upgrade_database
from app.db.session import create_db_engine

ROOT = Path(__file__).resolve().parents[2]
TABLES = {
    "api_keys",
    "jobs",
    "job_layers",
    "artifacts",
    "artifact_files",
    "profiles",
    "alembic_version",
}


def schema_diff(url: str) -> list[object]:
    engine = create_db_engine(url)
    try:
        with engine.connect() as conn:
            return list(compare_metadata(MigrationContext.configure(conn), Base.metadata))
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = create_db_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_migrations_match_models_and_round_trip(db_url: str) -> None:
    # db_url was built by `alembic upgrade head` (fixtures); nothing differs from the models.
    assert tables(db_url) >= TABLES
    assert schema_diff(db_url) == []
    downgrade_database(db_url, "base")
    assert tables(db_url) - {"alembic_version"} == set()
    upgrade_database(db_url)
    assert schema_diff(db_url) == []


def test_alembic_command_line_with_x_url(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    r = subprocess.run(
        [sys.executable, "-m", "alembic", "-x", f"url={url}", "upgrade", "head"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert tables(url) >= TABLES


def test_alembic_command_line_reads_settings(tmp_path: Path) -> None:
    env = {"HIGGS_DATA_DIR": str(tmp_path / "data"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert tables(f"sqlite:///{tmp_path / 'data' / 'higgs.db'}") >= TABLES
