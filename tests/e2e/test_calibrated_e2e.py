"""Calibrated HIGGS through the whole service, with real processes (uvicorn, a Celery worker,
PostgreSQL + Redis): `higgs submit --calibration FILE` uploads the text, submits, and the
job's summary and report name the text."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from devtools.stack import HIGGS
from tests.e2e.test_service_e2e import JOB_TIMEOUT_S, start_separate
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import TINY_TEXT

pytestmark = pytest.mark.slow


def test_submit_with_calibration_file(stack_factory: Any, tmp_path: Path) -> None:
    stack = stack_factory("redis-postgres")
    start_separate(stack)
    key = stack.create_key()
    text = tmp_path / "calibration.txt"
    text.write_text(TINY_TEXT * 20, encoding="utf-8")
    digest = hashlib.sha256(text.read_bytes()).hexdigest()
    conn = ["--url", stack.url, "--key", key]
    res = stack.run(
        [*HIGGS, "submit", MODEL, "--bits", "4", "--calibration", str(text),
         "--calibration-tokens", "256", "--wait", *conn],
        timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    job_id = res.stdout.strip().splitlines()[-1]
    assert f"sha256 {digest[:12]}" in res.stdout, res.stdout + res.stderr
    with stack.client(key) as c:
        job = c.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "succeeded", job
        cal = job["summary"]["calibration"]
        assert cal["sha256"] == digest and cal["tokens"] == 256
        assert cal["source"] == "upload:" + job["config"]["calibration"]["id"]
        report = c.get(f"/v1/jobs/{job_id}/report").json()
        assert report["metrics"]["calibration"]["layers_calibrated"] > 0
    # An unusable file: one line, nothing uploaded or submitted.
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    bad = stack.run([*HIGGS, "submit", MODEL, "--bits", "4", "--calibration", str(empty), *conn],
                    check=False)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "empty" in bad.stderr
    with stack.client(key) as c:
        assert len(c.get("/v1/calibrations").json()["data"]) == 1
        assert len(c.get("/v1/jobs").json()["data"]) == 1
