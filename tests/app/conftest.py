"""Fixtures for the service tests: migrated databases (SQLite always, PostgreSQL when
HIGGS_TEST_POSTGRES_URL is set), sessions, settings and an app client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.db.session import create_db_engine, session_factory
from app.keys.service import create_key
from app.main import create_app
from app.settings import Settings
from tests.app.dbutil import (
    POSTGRES_SKIP_REASON,
    empty_postgres,
    fresh_postgres_database,
    migrated_sqlite_template,
    postgres_server_url,
    sqlite_copy,
)
from tests.fixtures import METRICS_KEY


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return migrated_sqlite_template(tmp_path_factory.mktemp("sqlite-template"))


@pytest.fixture(scope="session")
def postgres_session_db() -> Iterator[str]:
    server = postgres_server_url()
    if server is None:
        pytest.skip(POSTGRES_SKIP_REASON)
    with fresh_postgres_database(server) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, sqlite_template: Path, tmp_path: Path) -> str:
    """A migrated, empty database: a SQLite file, then the session's PostgreSQL database."""
    if request.param == "sqlite":
        return sqlite_copy(sqlite_template, tmp_path / "higgs.db")
    url: str = request.getfixturevalue("postgres_session_db")
    empty_postgres(url)
    return url


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    return sqlite_copy(sqlite_template, tmp_path / "higgs.db")


@pytest.fixture
def sessions(db_url: str) -> Iterator[sessionmaker[Session]]:
    engine = create_db_engine(db_url)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Settings:
    """Service settings on the test database; local model "tiny" exists in models_dir."""
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    return Settings(
        data_dir=tmp_path / "data",
        database_url=db_url,
        models_dir=models,
        metrics_key=METRICS_KEY,
    )


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture
def auth(sessions: sessionmaker[Session]) -> dict[str, str]:
    with sessions() as s:
        _, key = create_key(s, "alice")
    return {"Authorization": f"Bearer {key}"}
