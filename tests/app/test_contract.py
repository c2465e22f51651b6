"""The OpenAPI document against the running server: schemathesis with every check
(`--checks all`), a fixed seed and a bounded number of examples, against a real uvicorn with a
succeeded job whose artifact files the download operations are pointed at. Zero failures."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.manifest import artifact_row
from app.jobs import state
from app.keys.service import create_key
from app.main import create_app
from app.params import NO_CONTROL_CHARS
from app.settings import Settings
from tests.app.factories import make_job
from tests.fixtures import serve_app

SEED = 20261130
MAX_EXAMPLES = 12
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")

# Requests the schema cannot fully describe, answered 422 although schema-valid: a model id
# must name a served model (or a Hub id), bits must fit the chosen grid, a cursor must be one
# this API issued. Everywhere else a schema-valid request must be accepted.
CONFIG = """
[[operations]]
include-operation-id = ["submit_job", "create_plan", "list_jobs"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "404", "409", "422", "429"]

[[operations]]
include-operation-id = ["get_artifact", "download_file", "download_archive"]
parameters = {{ "path.job_id" = "{job}", "path.format" = "native", "path.path" = "model.safetensors" }}
"""


@pytest.fixture
def contract_server(sqlite_url: str, tmp_path: Path) -> Iterator[tuple[str, Settings]]:
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=sqlite_url,
        models_dir=models,
        # The fuzzer submits hundreds of jobs with one key: no rate limit or quota here
        # (tests/app/test_limits.py covers them).
        rate_limit_per_s=0,
        max_active_jobs_per_key=0,
        # Per-key Hub tokens can be stored (without a secret PUT hub-token is not_supported).
        hub_token_secret="contract tests",
    )
    with serve_app(settings) as url:
        yield url, settings


def succeeded_job(sessions: sessionmaker[Session], key_id: str, root: Path) -> str:
    with sessions() as s:
        job = make_job(s, key_id)
    store = root / "store" / job.id / "native"
    store.mkdir(parents=True)
    (store / "model.safetensors").write_bytes(os.urandom(200_000))
    (store / "config.json").write_text('{"model_type": "llama"}')
    with sessions() as s:
        state.claim(s, job.id, "w")
        state.succeed(s, job.id, {"layers": []}, [], [artifact_row("native", store)])
    return job.id


@pytest.mark.slow
def test_schemathesis_all_checks_find_nothing(
    contract_server: tuple[str, Settings], tmp_path: Path
) -> None:
    from app.db.session import create_db_engine, session_factory

    url, settings = contract_server
    engine = create_db_engine(settings.database_url)
    try:
        sessions = session_factory(engine)
        with sessions() as s:
            row, key = create_key(s, "contract")
        job = succeeded_job(sessions, row.id, tmp_path)
    finally:
        engine.dispose()
    assert httpx.get(f"{url}/v1/jobs/{job}", headers={"Authorization": f"Bearer {key}"}).is_success
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG.format(job=job))
    cmd = [
        str(SCHEMATHESIS),
        "--config-file",
        str(config),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        "--seed",
        str(SEED),
        "--max-examples",
        str(MAX_EXAMPLES),
        "--generation-database",
        "none",
        "--workers",
        "1",
        "--no-color",
        "-H",
        f"Authorization: Bearer {key}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-20000:]
    assert "failures" not in report.split("Test cases:")[-1], report[-5000:]


def test_every_path_parameter_refuses_control_characters(settings: Settings) -> None:
    """Each id or file path in a URL is declared without control characters, so clients and the
    fuzzer above know it, and the API answers such a request 422 before any query runs."""
    doc = create_app(settings).openapi()
    seen = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            for param in op.get("parameters", []):
                if param["in"] != "path" or "enum" in param["schema"]:
                    continue
                seen.append((method, path, param["name"]))
                assert param["schema"].get("pattern") == NO_CONTROL_CHARS, (method, path, param)
    assert ("get", "/v1/calibrations/{calibration_id}", "calibration_id") in seen
    assert ("get", "/v1/jobs/{job_id}/artifacts/{format}/files/{path}", "path") in seen
