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


def test_artifact_paths_become_store_uris_and_back(db_url: str, tmp_path: Path) -> None:
    """0004_artifact_store: a row written with an absolute path (before) reads as a file://
    URI (after), which the local store serves; downgrading gives the path back."""
    from sqlalchemy import text

    downgrade_database(db_url, "0003_webhooks")
    root = tmp_path / "art dir" / "job1" / "1.ab" / "native"
    engine = create_db_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO api_keys (id, name, prefix, key_hash, created_at) "
                    "VALUES ('k1', 'k', 'p', :h, CURRENT_TIMESTAMP)"
                ),
                {"h": "0" * 64},
            )
            conn.execute(
                text(
                    "INSERT INTO jobs (id, api_key_id, request_hash, request, config, model_id, "
                    "status, progress_done, progress_total, attempts, cancel_requested, "
                    "created_at, updated_at) VALUES ('job1', 'k1', :h, '{}', '{}', 'm', "
                    "'succeeded', 0, 0, 1, false, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                ),
                {"h": "0" * 64},
            )
            conn.execute(
                text(
                    "INSERT INTO artifacts (job_id, format, root, total_bytes, sha256, created_at) "
                    "VALUES ('job1', 'native', :root, 0, :h, CURRENT_TIMESTAMP)"
                ),
                {"root": str(root), "h": "0" * 64},
            )
        upgrade_database(db_url)
        with engine.connect() as conn:
            uri = conn.execute(text("SELECT uri FROM artifacts")).scalar_one()
        assert uri == root.as_uri() and "%20" in uri
        from app.artifacts.store import uri_path

        assert uri_path(uri) == root
        downgrade_database(db_url, "0003_webhooks")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT root FROM artifacts")).scalar_one() == str(root)
        upgrade_database(db_url)
    finally:
        engine.dispose()
