"""Disk held by jobs, with real processes (uvicorn, Celery workers, Redis, PostgreSQL): the scratch
of an attempt whose pool process was killed is removed by the sweep and reported in the failed
job's error, and the per-key disk quota refuses a submission of a key already at it and fails a
running job that goes past it, with nothing left on disk and the worker alive."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from app.jobs.service import job_view
from devtools.stack import Stack
from tests.e2e.servers import wait_finished
from tests.e2e.test_faults_e2e import START_TIMEOUT_S, _setup
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import files_under
from worker.scratch import tree_bytes

pytestmark = pytest.mark.slow

BODY = {"model": {"id": MODEL}, "target": {"bits": 4}}
TERMINAL = ("succeeded", "failed", "cancelled")


def test_the_scratch_of_a_killed_last_attempt_is_swept_and_reported(
    stack_factory: Any, e2e_models_dir: Path
) -> None:
    stack: Stack = stack_factory("redis-postgres")
    svc = _setup(
        stack,
        e2e_models_dir,
        {
            "HIGGS_DEBUG_LAYER_DELAY_S": "0.6",
            "HIGGS_HEARTBEAT_TIMEOUT_S": "600",
            # The kill is the last attempt: nothing re-runs the job and clears its folder.
            "HIGGS_MAX_ATTEMPTS": "1",
        },
    )
    try:
        job_id = svc.submit()
        staging = stack.artifacts_dir / ".staging"

        def written() -> bool:
            return any(
                p.relative_to(staging).parts[0].startswith(job_id) for p in files_under(staging)
            )

        job = svc.wait(
            job_id,
            lambda j: j.stage == "quantizing" and j.progress_done >= 2 and written(),
            "quantizing with files in staging",
            START_TIMEOUT_S,
        )
        before = tree_bytes(staging)
        assert before > 0
        assert job.worker_id is not None
        pool_pid = int(job.worker_id.rsplit(":", 1)[1])
        assert stack.procs[-1].popen.pid != pool_pid
        os.kill(pool_pid, signal.SIGKILL)

        job = svc.wait(job_id, lambda j: j.status in TERMINAL, "the job's failure", 60)
        assert (job.status, job.error_code) == ("failed", "worker_lost")
        job = svc.wait(
            job_id, lambda j: j.scratch_reclaimed_bytes is not None, "the sweep's count", 30
        )
        assert files_under(staging) == [], "the dead attempt's scratch is still there"
        assert job.scratch_reclaimed_bytes is not None and job.scratch_reclaimed_bytes >= before
        error = job_view(job).error
        assert error is not None and error.scratch_reclaimed_bytes == job.scratch_reclaimed_bytes
        assert stack.procs[-1].alive()  # the worker lives on
    finally:
        svc.close()


def _worker_ready(stack: Stack, extra_env: dict[str, str]) -> Any:
    worker = stack.start_worker(extra_env=extra_env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while "higgs worker ready" not in worker.log.read_text(errors="replace"):
        assert worker.alive(), worker.tail()
        assert time.monotonic() < deadline, f"the worker is not ready:\n{worker.tail()}"
        time.sleep(0.2)
    return worker


def test_the_disk_quota_refuses_a_full_key_and_stops_a_job_past_it(
    stack_factory: Any, e2e_models_dir: Path
) -> None:
    stack: Stack = stack_factory("redis-postgres")
    # The API enforces a quota of one byte; the first worker none (so that key A gets an
    # artifact), the second one byte (so that key B's job goes past it while running).
    stack.env["HIGGS_DISK_QUOTA_BYTES_PER_KEY"] = "1"
    stack.migrate()
    stack.start_api()
    key_a, key_b = stack.create_key("a"), stack.create_key("b")
    first = _worker_ready(stack, {"HIGGS_DISK_QUOTA_BYTES_PER_KEY": "0"})
    with stack.client(key_a) as a, stack.client(key_b) as b:
        r = a.post("/v1/jobs", json=BODY)
        assert r.status_code == 202, r.text
        job = wait_finished(a, r.json()["id"], 180, stack.logs)
        assert job["status"] == "succeeded", job
        held = sum(art["bytes"] for art in job["artifacts"])
        assert held > 1

        r = a.post("/v1/jobs", json=BODY)
        assert r.status_code == 422, r.text
        problem = r.json()
        assert r.headers["content-type"].startswith("application/problem+json")
        assert problem["code"] == "disk_quota_exceeded"
        assert "HIGGS_DISK_QUOTA_BYTES_PER_KEY = 1" in problem["detail"]

        assert first.stop() == 0  # SIGTERM: a warm shutdown
        r = b.post("/v1/jobs", json=BODY)  # key B holds nothing yet
        assert r.status_code == 202, r.text
        job_b = r.json()["id"]
        worker = _worker_ready(
            stack, {"HIGGS_DISK_QUOTA_BYTES_PER_KEY": "1", "HIGGS_DEBUG_LAYER_DELAY_S": "0.3"}
        )
        job = wait_finished(b, job_b, 180, stack.logs)
        assert job["status"] == "failed", job
        assert job["error"]["code"] == "disk_quota_exceeded", job["error"]
        assert job["error"]["scratch_reclaimed_bytes"] > 0
        assert job["artifacts"] == []
        assert files_under(stack.artifacts_dir / ".staging") == []
        assert not (stack.artifacts_dir / job_b).exists()
        assert worker.alive()
