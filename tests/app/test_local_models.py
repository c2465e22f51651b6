"""Local models without a shared disk: the API (no HIGGS_MODELS_DIR of its own) accepts the
local names that workers registered from their models folder, or that an operator registered
with `higgs models`, and answers 422 naming model.id for any other bare name."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.db.base import utcnow
from app.jobs import local_models
from app.keys.service import create_key
from app.main import create_app
from app.settings import Settings
from tests.fixtures import assert_problem
from worker.models import register_local_models

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def api(sqlite_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str], Settings]]:
    # The API's settings name no models folder: it has no worker disk.
    settings = Settings(data_dir=tmp_path / "api-data", database_url=sqlite_url)
    assert settings.models_dir is None
    with TestClient(create_app(settings)) as c:
        sessions: sessionmaker[Session] = c.app.state.sessions  # type: ignore[attr-defined]
        with sessions() as s:
            _, key = create_key(s, "alice")
        yield c, {"Authorization": f"Bearer {key}"}, settings


def submit(c: TestClient, auth: dict[str, str], model: str, **extra: str) -> object:
    return c.post(
        "/v1/jobs", json={"model": {"id": model, **extra}, "target": {"bits": 4}}, headers=auth
    )


def worker_models(tmp_path: Path) -> Path:
    """A worker's models folder: two checkpoints, a folder without config.json, a bad name."""
    d = tmp_path / "worker-models"
    for name in ("tiny", "small-llama", "no-config", "bad..name"):
        (d / name).mkdir(parents=True)
        if name != "no-config":
            (d / name / "config.json").write_text("{}")
    return d


def test_worker_registered_models_are_accepted_and_others_are_422(
    api: tuple[TestClient, dict[str, str], Settings], tmp_path: Path
) -> None:
    c, auth, _ = api
    sessions: sessionmaker[Session] = c.app.state.sessions  # type: ignore[attr-defined]
    # Nothing registered: a bare name is a Hub id, as without a models folder before.
    assert submit(c, auth, "gpt2").status_code == 202  # type: ignore[attr-defined]
    names = register_local_models(sessions, worker_models(tmp_path))
    assert names == ["small-llama", "tiny"]
    r = submit(c, auth, "tiny")
    assert r.status_code == 202, r.text  # type: ignore[attr-defined]
    body = assert_problem(submit(c, auth, "unknown-model"), 422, "model.id")
    assert "unknown-model" in body["detail"] and "worker-models" not in body["detail"]
    assert_problem(submit(c, auth, "tiny", revision="main"), 422, "model.revision")
    assert submit(c, auth, "org/hub-model").status_code == 202  # type: ignore[attr-defined]
    # Plans check names the same way.
    r = c.post(
        "/v1/plans", json={"model": {"id": "unknown-model"}, "target": {"bits": 4}}, headers=auth
    )
    assert r.status_code == 422
    # A model removed from the worker's folder is gone from the registry at its next sweep.
    import shutil

    shutil.rmtree(tmp_path / "worker-models" / "tiny")
    assert register_local_models(sessions, tmp_path / "worker-models") == ["small-llama"]
    assert_problem(submit(c, auth, "tiny"), 422, "model.id")


def test_rows_of_a_worker_not_seen_for_long_do_not_count(
    api: tuple[TestClient, dict[str, str], Settings],
) -> None:
    c, auth, settings = api
    sessions: sessionmaker[Session] = c.app.state.sessions  # type: ignore[attr-defined]
    old = utcnow() - timedelta(seconds=local_models.stale_after_s(settings) + 5)
    with sessions() as s:
        local_models.register(s, ["tiny"], "gone-host:/models", now=old)
        assert not local_models.is_registered(s, "tiny", local_models.stale_after_s(settings))
        local_models.register(s, ["tiny"], "live-host:/models")
        assert local_models.is_registered(s, "tiny", local_models.stale_after_s(settings))
    assert submit(c, auth, "tiny").status_code == 202  # type: ignore[attr-defined]


def higgs(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HIGGS_")}
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from higgs_cli.main import main; sys.exit(main())",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
    )


def test_operator_registers_names_with_the_cli(
    api: tuple[TestClient, dict[str, str], Settings],
) -> None:
    c, auth, settings = api
    env = {"HIGGS_DATABASE_URL": settings.database_url, "HIGGS_DATA_DIR": str(settings.data_dir)}
    r = higgs("models", "register", "hand-made", env=env)
    assert r.returncode == 0, r.stderr
    assert submit(c, auth, "hand-made").status_code == 202  # type: ignore[attr-defined]
    assert_problem(submit(c, auth, "other"), 422, "model.id")
    listed = higgs("models", "list", env=env)
    assert "hand-made  operator  no expiry" in listed.stdout
    bad = higgs("models", "register", "owner/name", env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("higgs: error:") and "Hub id" in bad.stderr
    r = higgs("models", "unregister", "hand-made", env=env)
    assert r.returncode == 0 and "unregistered 1" in r.stdout
    # Nothing registered any more: a bare name is a Hub id again.
    assert submit(c, auth, "hand-made").status_code == 202  # type: ignore[attr-defined]
    assert "no local models" in higgs("models", "list", env=env).stdout
