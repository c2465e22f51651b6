"""A job's memory limit and a crash in native code, with real processes (uvicorn, a Celery
worker, SQLite and the filesystem broker):

- a worker whose HIGGS_WORKER_MAX_MEMORY_MB is below what the job needs fails it once as
  `resource_limit`, naming the setting, and lives on;
- a pool process that crashes in the middle of a job (SIGSEGV, as llama.cpp's decode did on
  AVX-512 with repacked Q4_K weights; GGML_ASSERT's abort() ends the same way with SIGABRT)
  fails the job once as `native_crash` instead of re-running it as a lost worker, and the
  worker runs the next job. (A SIGABRT sent from outside is not a crash: billiard's handler
  turns it into an exit, so the test sends SIGSEGV.)"""

from __future__ import annotations

import signal
import time
from typing import Any

import psutil
import pytest

from tests.e2e.test_service_e2e import SLOW_WORKER, poll, start_separate, submit, terminal
from tests.fixtures import files_under

pytestmark = pytest.mark.slow


def _nothing_left(stack: Any) -> None:
    left = [p for p in files_under(stack.artifacts_dir) if p.name != ".keep"]
    assert left == [], left


def test_a_job_past_the_memory_limit_fails_once_and_the_worker_lives(stack_factory: Any) -> None:
    stack = stack_factory("local")
    start_separate(stack, {"HIGGS_WORKER_MAX_MEMORY_MB": "64"})
    worker = stack.procs[-1]
    key = stack.create_key()
    with stack.client(key) as c:
        job_id = submit(c)
        job = poll(c, job_id, terminal, stack=stack)
        assert job["status"] == "failed", job
        assert job["error"]["code"] == "resource_limit", job["error"]
        assert "HIGGS_WORKER_MAX_MEMORY_MB=64" in job["error"]["message"]
        assert job["attempts"] == 1
        _nothing_left(stack)
        assert worker.alive() and c.get("/readyz").status_code == 200, stack.logs()


def _pool_process(worker: Any) -> psutil.Process:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        kids = psutil.Process(worker.popen.pid).children()
        if len(kids) == 1:
            return kids[0]
        time.sleep(0.2)
    raise AssertionError(f"the worker has no single pool process: {kids}")


def test_a_native_crash_fails_the_job_once(stack_factory: Any) -> None:
    stack = stack_factory("local")
    # Celery reports a lost pool process after worker_lost_wait (10 s); the test env's 4 s
    # heartbeat timeout would let the sweep re-queue the job first (production: 120 s).
    stack.env["HIGGS_HEARTBEAT_TIMEOUT_S"] = "30"
    start_separate(stack, SLOW_WORKER)
    worker = stack.procs[-1]
    key = stack.create_key()
    with stack.client(key) as c:
        job_id = submit(c)
        poll(c, job_id, lambda j: j["stage"] == "quantizing", stack=stack)
        _pool_process(worker).send_signal(signal.SIGSEGV)  # a segfault in native code
        job = poll(c, job_id, terminal, stack=stack)
        assert job["status"] == "failed", job
        assert job["error"]["code"] == "native_crash", job["error"]
        assert "SIGSEGV" in job["error"]["message"]
        assert job["attempts"] == 1
        assert worker.alive(), stack.logs()
        _nothing_left(stack)
        # The worker replaced its pool process and runs the next job.
        nxt = poll(c, submit(c), terminal, stack=stack)
        assert nxt["status"] == "succeeded", nxt
