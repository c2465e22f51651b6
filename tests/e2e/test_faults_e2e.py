"""The worker under faults, with real processes: a Celery worker (main process + pool
process), PostgreSQL and Redis servers of the test's own that it stops, restarts and wipes,
a real full filesystem (a small tmpfs). Jobs are created and sent exactly as POST /v1/jobs
does (service functions + the API's Celery client) and watched in the database, which stays
readable for the test between outages."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from app.db.models import Job
from app.db.session import create_db_engine, session_factory
from app.jobs import state
from app.queue import enqueue_job
from app.settings import Settings
from devtools.scratch import scratch_postgres
from devtools.stack import Stack
from tests.e2e.servers import PrivatePostgres, PrivateRedis
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import files_under
from tests.worker.helpers import create_job

pytestmark = pytest.mark.slow

BODY = {"model": {"id": MODEL}, "target": {"bits": 4}}
START_TIMEOUT_S = 180  # the worker imports torch and transformers before its first job
TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture
def pg() -> Iterator[PrivatePostgres]:
    try:
        server = PrivatePostgres()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot start a private PostgreSQL server: {e}")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_server() -> Iterator[PrivateRedis]:
    try:
        server = PrivateRedis()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"cannot start a private Redis server: {e}")
    try:
        yield server
    finally:
        server.close()


class Service:
    """A stack's database as the test sees it, and job submission as the API does it."""

    def __init__(self, stack: Stack, models_dir: Path) -> None:
        self.stack = stack
        env = stack.env
        self.settings = Settings(
            data_dir=Path(env["HIGGS_DATA_DIR"]),
            database_url=env.get("HIGGS_DATABASE_URL", ""),
            broker_url=env.get("HIGGS_BROKER_URL", ""),
            artifacts_dir=Path(env["HIGGS_ARTIFACTS_DIR"])
            if env.get("HIGGS_ARTIFACTS_DIR")
            else None,
            models_dir=models_dir,
        )
        self.engine = create_db_engine(self.settings.database_url)
        self.sessions: sessionmaker[Session] = session_factory(self.engine)

    def submit(self) -> str:
        job_id = create_job(self.sessions, self.settings, BODY)
        assert enqueue_job(self.settings, job_id), "the broker refused the job"
        with self.sessions() as s:
            state.mark_enqueued(s, job_id)
        return job_id

    def job(self, job_id: str) -> Job | None:
        """The job row, or None while the database is unreachable."""
        try:
            with self.sessions() as s:
                job = s.get(Job, job_id)
                if job is not None:
                    s.expunge(job)
                return job
        except OperationalError:
            return None

    def wait(
        self, job_id: str, cond: Callable[[Job], bool], what: str, timeout: float = 120
    ) -> Job:
        deadline = time.monotonic() + timeout
        job = None
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job is not None and cond(job):
                return job
            time.sleep(0.1)
        last = (
            "unknown"
            if job is None
            else (job.status, job.stage, job.progress_done, job.attempts, job.error_code)
        )
        raise AssertionError(
            f"job {job_id}: no {what} after {timeout}s (last: {last})\n{self.stack.logs()}"
        )

    def close(self) -> None:
        self.engine.dispose()


def _worker_log(stack: Stack) -> str:
    return "\n".join(p.log.read_text(errors="replace") for p in stack.procs if p.name == "worker")


def _setup(stack: Stack, models_dir: Path, env: dict[str, str]) -> Service:
    """Migrate, start one worker and wait until it consumes (it imports torch first)."""
    stack.env.update(env)
    stack.migrate()
    service = Service(stack, models_dir)
    worker = stack.start_worker()
    deadline = time.monotonic() + START_TIMEOUT_S
    while "higgs worker ready" not in worker.log.read_text(errors="replace"):
        assert worker.alive(), worker.tail()
        assert time.monotonic() < deadline, f"the worker is not ready:\n{worker.tail()}"
        time.sleep(0.2)
    return service


@pytest.fixture
def services() -> Iterator[list[Service]]:
    made: list[Service] = []
    yield made
    for s in made:
        s.close()


def _on_private_servers(
    stack_factory: Any,
    pg: PrivatePostgres,
    redis_server: PrivateRedis,
    cleanups: list[Callable[[], None]],
) -> Stack:
    stack: Stack = stack_factory("local")
    db_url, drop = scratch_postgres(pg.url, "higgs_faults")
    cleanups.append(drop)
    stack.env["HIGGS_DATABASE_URL"] = db_url
    stack.env["HIGGS_BROKER_URL"] = redis_server.url
    return stack


@pytest.fixture
def cleanups() -> Iterator[list[Callable[[], None]]]:
    fns: list[Callable[[], None]] = []
    yield fns
    for fn in fns:
        try:
            fn()
        except Exception as e:  # the server may be down after a failed test
            sys.stderr.write(f"cleanup failed: {e}\n")


# ---------------------------------------------------------------- PostgreSQL restarted


def test_postgres_restarts_during_a_running_job_cost_no_attempt(
    pg: PrivatePostgres,
    redis_server: PrivateRedis,
    stack_factory: Any,  # after the servers: its processes stop before the servers do
    e2e_models_dir: Path,
    services: list[Service],
    cleanups: list[Callable[[], None]],
) -> None:
    stack = _on_private_servers(stack_factory, pg, redis_server, cleanups)
    # Heartbeat timeout 4 s and a sweep every second: an outage judged as a dead worker would
    # re-queue the job (a second attempt) well within each outage.
    svc = _setup(stack, e2e_models_dir, {"HIGGS_DEBUG_LAYER_DELAY_S": "0.6"})
    services.append(svc)
    job_id = svc.submit()
    svc.wait(
        job_id,
        lambda j: j.stage == "quantizing" and j.progress_done >= 2,
        "quantizing",
        START_TIMEOUT_S,
    )

    pg.stop()  # a short restart: a few seconds
    time.sleep(3)
    pg.start()
    job = svc.wait(job_id, lambda j: j.progress_done >= 5, "progress after the short restart")
    assert (job.status, job.attempts) == ("running", 1)

    pg.stop()  # a long outage: 20 s, five heartbeat timeouts
    time.sleep(20)
    pg.start()
    job = svc.wait(job_id, lambda j: j.status in TERMINAL, "the end of the job", 120)
    assert (job.status, job.attempts, job.error_code) == ("succeeded", 1, None), job.error_message
    log = _worker_log(stack)
    assert "database unavailable" in log and "database back after" in log
    assert "stale-job checks paused" in log  # the sweep saw the outage and held back
    assert len(list((stack.artifacts_dir / job_id).iterdir())) == 1


# ---------------------------------------------------------------- Redis restarted empty


def test_jobs_queued_when_redis_restarts_without_persistence_still_run(
    pg: PrivatePostgres,
    redis_server: PrivateRedis,
    stack_factory: Any,  # after the servers: its processes stop before the servers do
    e2e_models_dir: Path,
    services: list[Service],
    cleanups: list[Callable[[], None]],
) -> None:
    stack = _on_private_servers(stack_factory, pg, redis_server, cleanups)
    svc = _setup(
        stack, e2e_models_dir, {"HIGGS_DEBUG_LAYER_DELAY_S": "0.3", "HIGGS_QUEUED_RESEND_S": "3"}
    )
    services.append(svc)
    first = svc.submit()
    svc.wait(first, lambda j: j.status == "running", "a running first job", START_TIMEOUT_S)
    waiting = [
        svc.submit(),
        svc.submit(),
    ]  # the worker (concurrency 1) is busy: these wait in Redis
    import redis

    r = redis.Redis.from_url(redis_server.url)
    assert r.llen(svc.settings.task_queue) == 2
    redis_server.restart()  # every message is gone
    assert r.llen(svc.settings.task_queue) == 0
    for job_id in [first, *waiting]:
        job = svc.wait(job_id, lambda j: j.status in TERMINAL, "the end of the job", 120)
        assert (job.status, job.attempts) == ("succeeded", 1), (job.error_code, job.error_message)
    assert "sending them again" in _worker_log(stack)


# ---------------------------------------------------------------- a pool process killed


@pytest.mark.parametrize("kind", ["local", "redis-postgres"])
def test_a_killed_pool_process_gets_its_job_back_within_seconds(
    stack_factory: Any, e2e_models_dir: Path, services: list[Service], kind: str
) -> None:
    stack: Stack = stack_factory(kind)
    # A heartbeat timeout far longer than the test: only the main process's WorkerLostError
    # handling can bring the job back this fast.
    svc = _setup(
        stack,
        e2e_models_dir,
        {"HIGGS_DEBUG_LAYER_DELAY_S": "0.6", "HIGGS_HEARTBEAT_TIMEOUT_S": "600"},
    )
    services.append(svc)
    job_id = svc.submit()
    job = svc.wait(
        job_id,
        lambda j: j.stage == "quantizing" and j.progress_done >= 2,
        "quantizing",
        START_TIMEOUT_S,
    )
    assert job.worker_id is not None
    pool_pid = int(job.worker_id.rsplit(":", 1)[1])
    assert stack.procs[-1].popen.pid != pool_pid  # the pool process, not the worker's main process
    os.kill(pool_pid, signal.SIGKILL)
    t0 = time.monotonic()
    job = svc.wait(
        job_id, lambda j: j.attempts == 2 and j.status != "queued", "the second claim", 30
    )
    requeue_s = time.monotonic() - t0
    assert requeue_s < 15, f"re-claimed {requeue_s:.1f}s after the kill"
    job = svc.wait(job_id, lambda j: j.status in TERMINAL, "the end of the job", 120)
    assert (job.status, job.attempts) == ("succeeded", 2), (job.error_code, job.error_message)
    assert len(list((stack.artifacts_dir / job_id).iterdir())) == 1
    assert files_under(stack.artifacts_dir / ".staging") == []
    assert stack.procs[-1].alive()  # the worker itself lives on


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_volume() -> Iterator[Path]:
    """A 3 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="higgs-full-"))
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if out.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs: {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        mnt.rmdir()


def test_a_full_disk_is_storage_full_then_success_once_space_is_freed(
    stack_factory: Any, e2e_models_dir: Path, services: list[Service], small_volume: Path
) -> None:
    stack: Stack = stack_factory("local")
    artifacts = small_volume / "artifacts"
    artifacts.mkdir()
    filler = small_volume / "filler.bin"
    # Leave 100 KiB: the tiny model's artifacts need several times that.
    free = os.statvfs(small_volume).f_bavail * os.statvfs(small_volume).f_frsize
    filler.write_bytes(b"\0" * (free - 100 * 1024))
    svc = _setup(stack, e2e_models_dir, {"HIGGS_ARTIFACTS_DIR": str(artifacts)})
    services.append(svc)
    jobs = [svc.submit(), svc.submit()]
    for job_id in jobs:
        job = svc.wait(
            job_id,
            lambda j: j.error_code == "storage_full" and j.status == "queued",
            "storage_full",
            START_TIMEOUT_S,
        )
        assert job.attempts == 0 and "storage is full" in (job.error_message or "")
        assert str(small_volume) not in (job.error_message or "")
    time.sleep(2)  # several sweeps: nothing is sent again while the volume stays full
    for job_id in jobs:
        row = svc.job(job_id)
        assert row is not None and (row.status, row.error_code, row.attempts) == (
            "queued",
            "storage_full",
            0,
        )
    filler.unlink()  # the operator frees space
    for job_id in jobs:
        job = svc.wait(job_id, lambda j: j.status in TERMINAL, "the end of the job", 120)
        assert (job.status, job.attempts, job.error_code) == ("succeeded", 1, None), (
            job.error_message
        )
        assert len(list((artifacts / job_id).iterdir())) == 1
    log = _worker_log(stack)
    assert len(re.findall(r"ERROR.*storage full:", log)) == 1, log  # told once, not per job
    assert "Traceback" not in log
    assert "internal_error" not in log
