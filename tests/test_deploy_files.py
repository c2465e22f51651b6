"""No Docker engine runs here, so the deployment files are checked for what can be checked:
docker-compose.yml parses, every command it names exists in the package and starts (help /
import / a real migration), every HIGGS_* variable is a setting, the Dockerfile has the stages
and files the compose file relies on, and the worker reserves a GPU."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def _stages() -> dict[str, str]:
    """Dockerfile stage name -> the CMD of that stage (JSON form), '' when none."""
    stages: dict[str, str] = {}
    current = None
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"^FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(1)
            stages[current] = ""
        elif current and line.startswith("CMD "):
            stages[current] = line[4:].strip()
    return stages


def test_compose_has_the_production_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"api", "worker", "redis", "postgres", "migrate"} <= set(services)
    for name, svc in services.items():
        for dep in svc.get("depends_on") or {}:
            assert dep in services, f"{name} depends on unknown service {dep}"
    assert services["migrate"]["restart"] == "no"
    assert services["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)


def test_build_targets_exist_in_the_dockerfile(compose: dict[str, Any]) -> None:
    stages = _stages()
    for name, svc in compose["services"].items():
        if "build" in svc:
            assert svc["build"]["target"] in stages, f"{name}: no stage {svc['build']['target']!r}"
    # The API image is light: torch is installed only in the worker stage.
    text = DOCKERFILE.read_text()
    api_part = text.split("AS api", 1)[1].split("AS worker", 1)[0]
    worker_part = text.split("AS worker", 1)[1]
    assert "torch" not in re.sub(r"#.*", "", api_part)
    assert "torch==" in worker_part and "cu1" in worker_part


def test_dockerfile_copies_files_that_exist() -> None:
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), f"Dockerfile copies {src}, which is not in the repository"


def test_every_higgs_variable_is_a_setting(compose: dict[str, Any]) -> None:
    from app.settings import Settings

    fields = set(Settings.model_fields)
    env = compose["x-higgs-env"]
    for name, svc in compose["services"].items():
        for var in svc.get("environment") or {}:
            if var.startswith("HIGGS_"):
                assert var[len("HIGGS_") :].lower() in fields, f"{name}: {var} is not a Settings field"
    for var in env:
        if var.startswith("HIGGS_"):
            assert var[len("HIGGS_") :].lower() in fields, f"{var} is not a Settings field"
    # The values build valid settings (URLs of the production shape).
    s = Settings(**{k[len("HIGGS_") :].lower(): v for k, v in env.items() if k.startswith("HIGGS_") and v})
    assert s.database_url.startswith("postgresql+psycopg://") and s.broker_url.startswith("redis://")


def _commands(compose: dict[str, Any]) -> list[list[str]]:
    cmds = [svc["command"] for svc in compose["services"].values() if "build" in svc]
    cmds += [__import__("json").loads(c) for c in _stages().values() if c]
    return cmds


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, **kw)


def test_every_command_exists_and_starts(compose: dict[str, Any], tmp_path: Path) -> None:
    seen = set()
    for cmd in _commands(compose):
        assert isinstance(cmd, list), f"use the exec form for commands: {cmd!r}"
        prog = cmd[0]
        seen.add(prog)
        if prog == "uvicorn":
            target = cmd[1]
            module, attr = target.split(":")
            obj = getattr(importlib.import_module(module), attr)
            assert "--factory" in cmd and callable(obj)
            from fastapi import FastAPI

            from app.settings import Settings

            assert isinstance(obj(Settings(data_dir=tmp_path / "api")), FastAPI)
        elif prog == "celery":
            assert cmd[1:3] == ["-A", "worker.celery_app"] and cmd[3] == "worker"
            out = _run([sys.executable, "-m", "celery", *cmd[1:4], "--help"])
            assert out.returncode == 0, out.stderr
            from worker.celery_app import app

            app.loader.import_default_modules()  # what the worker does at start (include=)
            assert {"higgs.run_job", "higgs.sweep"} <= set(app.tasks)
            queues = cmd[cmd.index("-Q") + 1].split(",")
            assert {q.name for q in app.conf.task_queues} >= set(queues)
        elif prog == "alembic":
            assert cmd[1:] == ["upgrade", "head"]
            # A real migration, with the same command, on a throwaway SQLite file.
            env = {**__import__("os").environ, "HIGGS_DATA_DIR": str(tmp_path / "mig")}
            env.pop("HIGGS_DATABASE_URL", None)
            out = _run([sys.executable, "-m", "alembic", *cmd[1:]], env=env)
            assert out.returncode == 0, out.stderr
            assert (tmp_path / "mig" / "higgs.db").is_file()
        elif prog in ("redis-server", "pg_isready", "redis-cli", "python"):
            continue  # belong to the public images / the interpreter
        elif prog == "higgs":
            out = _run([sys.executable, "-c", "from higgs_cli.main import main; raise SystemExit(main())", *cmd[1:2], "--help"])
            assert out.returncode == 0, out.stderr
        else:
            raise AssertionError(f"unknown command {prog!r} in docker-compose.yml / Dockerfile")
    assert {"uvicorn", "celery", "alembic"} <= seen


def test_higgs_serve_exists() -> None:
    out = _run([sys.executable, "-c", "from higgs_cli.main import main; raise SystemExit(main())", "serve", "--help"])
    assert out.returncode == 0 and "--data-dir" in out.stdout, out.stderr
