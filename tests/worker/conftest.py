"""Worker fixtures: a migrated SQLite database, settings under tmp_path and a local model."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.db.migrate import upgrade_database
from app.db.session import create_db_engine, session_factory
from app.settings import Settings
from tests.fixtures import TINY_MODEL, build_tiny_checkpoint
from worker.config import RunnerConfig


@pytest.fixture(scope="session")
def migrated_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("worker-db") / "template.db"
    upgrade_database(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HIGGS_MODELS_DIR with one tiny random Llama named TINY_MODEL."""
    root = tmp_path_factory.mktemp("models")
    build_tiny_checkpoint("llama", root / TINY_MODEL)
    return root


@pytest.fixture
def settings(tmp_path: Path, models_dir: Path, migrated_db: Path) -> Settings:
    data = tmp_path / "data"
    data.mkdir()
    shutil.copyfile(migrated_db, data / "higgs.db")
    s = Settings(data_dir=data, models_dir=models_dir, heartbeat_timeout_s=2.0, enqueue_grace_s=0.0)
    s.ensure_dirs()
    return s


@pytest.fixture
def sessions(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = create_db_engine(settings.database_url)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


@pytest.fixture
def runner_cfg(settings: Settings) -> RunnerConfig:
    return RunnerConfig.from_settings(settings, "cpu")
