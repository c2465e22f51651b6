"""One job attempt's bookkeeping, shared by the runner (worker.runner) and the fan-out
(worker.fanout): the claim (compare-and-set queued -> running) and the claimed record, the
progress writer and its heartbeats, the attempt's outcome, and how a failure or a stop is
recorded. Every database write is retried through an outage (worker.dbretry)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db.models import CANCELLED, FAILED, RUNNING, Job
from app.jobs import state
from higgs_engine.errors import HiggsError
from worker.config import RunnerConfig
from worker.dbretry import DatabaseUnavailableError, retry_db
from worker.messages import message_roots, public_message

# An attempt's records go out under the runner's logger name, wherever they are written.
log = logging.getLogger("worker.runner")

# Engine error codes that are also job error codes, as they are (docs/api.md, job "error").
ENGINE_CODES = frozenset(
    {
        "invalid_config",
        "model_not_found",
        "unsupported_model",
        "corrupt_checkpoint",
        "infeasible_target",
        "profile_not_found",
    }
)

SessionFactory = sessionmaker[Session]


def job_error_code(exc: BaseException) -> str:
    """The job's error code for an exception escaping the engine."""
    if isinstance(exc, HiggsError):
        return exc.code if exc.code in ENGINE_CODES else "engine_error"
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return "out_of_memory"
    if type(exc).__name__ in ("SoftTimeLimitExceeded", "TimeLimitExceeded"):
        return "time_limit"
    return "internal_error"


def worker_id_of(pid: int) -> str:
    """The worker id of the process `pid` on this host (what a job or part row records as its
    owner)."""
    return f"{socket.gethostname()}:{pid}"


def default_worker_id() -> str:
    return worker_id_of(os.getpid())


# ---------------------------------------------------------------- progress + heartbeat


class ProgressWriter:
    """The engine's progress callback: writes stage/done/total (and so the heartbeat) to the
    job row, at most every `min_interval` seconds within a stage, and returns False once the
    job should stop (cancel requested, or this worker no longer owns the job)."""

    def __init__(
        self,
        sessions: SessionFactory,
        job_id: str,
        worker_id: str,
        *,
        min_interval: float = 0.5,
        layer_delay: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        db_retry_s: float = 300.0,
    ) -> None:
        self.sessions = sessions
        self.db_retry_s = db_retry_s
        self.job_id = job_id
        self.worker_id = worker_id
        self.min_interval = min_interval
        self.layer_delay = layer_delay
        self.clock = clock
        self.sleep = sleep
        self.stop = threading.Event()
        self.last: tuple[str, int, int] = ("", 0, 0)
        self._last_write = -1e18
        self._lock = threading.Lock()

    def write(self, stage: str, done: int, total: int) -> bool:
        def once() -> bool:
            with self.sessions() as s:
                return state.record_progress(
                    s, self.job_id, stage, done, total, worker_id=self.worker_id
                )

        # Through a database outage the engine waits here (retrying), then goes on.
        with self._lock:
            go = retry_db(once, f"progress of job {self.job_id}", self.db_retry_s)
        self._last_write = self.clock()
        if not go:
            self.stop.set()
        return go

    def __call__(self, stage: str, done: int, total: int) -> bool:
        if self.stop.is_set():
            return False
        changed = stage != self.last[0]
        self.last = (stage, done, total)
        due = self.clock() - self._last_write >= self.min_interval
        if (changed or due or done >= total) and not self.write(stage, done, total):
            return False
        if self.layer_delay and stage in ("quantizing", "profiling") and done > 0:
            self.sleep(self.layer_delay)
        return not self.stop.is_set()

    def beat(self) -> None:
        """A heartbeat between progress calls (long loads, long layers)."""

        def once() -> bool:
            with self.sessions() as s:
                return state.heartbeat(s, self.job_id, worker_id=self.worker_id)

        with self._lock:
            go = retry_db(once, f"heartbeat of job {self.job_id}", self.db_retry_s)
        if not go:
            self.stop.set()


@contextlib.contextmanager
def heartbeating(writer: ProgressWriter, interval: float) -> Iterator[None]:
    """Run writer.beat() every `interval` seconds in a daemon thread while the block runs."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(interval):
            try:
                writer.beat()
            except Exception as e:  # a missed beat is not fatal; the next one may work
                log.warning("heartbeat for job %s failed: %s", writer.job_id, e)

    t = threading.Thread(target=loop, name=f"heartbeat-{writer.job_id}", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join(timeout=5)


# ---------------------------------------------------------------- the attempt


@dataclass
class Outcome:
    status: str  # "skipped", "succeeded", "failed", "cancelled", "lost", "storage_full"
    detail: str = ""


def job_snapshot(sessions: SessionFactory, job_id: str, budget_s: float = 300.0) -> Job | None:
    def once() -> Job | None:
        with sessions() as s:
            job = s.get(Job, job_id, populate_existing=True)
            if job is not None:
                s.expunge(job)
            return job

    return retry_db(once, f"state of job {job_id}", budget_s)


def ours_now(
    sessions: SessionFactory, job_id: str, worker_id: str, status: str, budget_s: float
) -> bool:
    """After a write whose commit may have landed before its connection broke: is the job
    already in `status`, owned by this worker (then the write did happen)?"""
    job = job_snapshot(sessions, job_id, budget_s)
    return job is not None and job.status == status and job.worker_id == worker_id


@dataclass(frozen=True)
class Claimed:
    model_id: str
    request: dict[str, Any]
    config: dict[str, Any]
    pinned: str | None
    attempt: int


def claim_job(
    sessions: SessionFactory, job_id: str, worker_id: str, budget_s: float
) -> Claimed | None:
    tries = 0

    def once() -> Claimed | None:
        nonlocal tries
        tries += 1
        with sessions() as s:
            job = state.claim(s, job_id, worker_id)
            if job is None and tries > 1:
                # An earlier try may have committed the claim and lost the reply.
                row = s.get(Job, job_id, populate_existing=True)
                if row is not None and row.status == RUNNING and row.worker_id == worker_id:
                    job = row
            if job is None:
                return None
            return Claimed(
                job.model_id, dict(job.request), dict(job.config), job.model_revision, job.attempts
            )

    return retry_db(once, f"claim of job {job_id}", budget_s)


# dispatch(job_id, job attempt, part indexes): send the parts and their assembly (a chord).
Dispatch = Callable[[str, int, list[int]], bool]


@dataclass(frozen=True)
class Attempt:
    """One attempt at a job: where it records (sessions, job, worker), how it runs (the
    runner's config), where it reports progress and writes files, and what was claimed."""

    sessions: SessionFactory
    job_id: str
    worker_id: str
    cfg: RunnerConfig
    writer: ProgressWriter
    staging: Path
    claimed: Claimed
    dispatch: Dispatch | None = None


def fail_job(
    sessions: SessionFactory, job_id: str, worker_id: str, cfg: RunnerConfig, exc: Exception
) -> Outcome:
    code = job_error_code(exc)
    message = public_message(exc, message_roots(cfg))
    if code in ("internal_error", "engine_error"):
        log.exception("job %s failed", job_id)
    else:
        log.warning("job %s failed: %s: %s", job_id, code, message)
    tries = 0

    def once() -> None:
        nonlocal tries
        tries += 1
        try:
            with sessions() as s:
                state.fail(s, job_id, code, message or code, worker_id=worker_id)
        except state.IllegalTransitionError:
            if tries > 1 and ours_now(sessions, job_id, worker_id, FAILED, cfg.db_retry_s):
                return
            raise

    try:
        retry_db(once, f"failure of job {job_id}", cfg.db_retry_s)
    except state.IllegalTransitionError as e:
        log.warning("job %s: could not record the failure (%s)", job_id, e)
        return Outcome("lost", str(e))
    except DatabaseUnavailableError as e:
        log.error("job %s: could not record the failure: %s", job_id, e)
        return Outcome("lost", str(e))
    return Outcome("failed", f"{code}: {message}")


def stop_job(
    sessions: SessionFactory, job_id: str, worker_id: str, why: str, budget_s: float = 300.0
) -> Outcome:
    """The engine stopped on request: cancelled if the user asked and we own the job; else lost."""
    job = job_snapshot(sessions, job_id, budget_s)
    if job is None:
        return Outcome("lost", "the job row disappeared")
    if job.status == CANCELLED:
        return Outcome("cancelled", why)
    if job.status == RUNNING and job.worker_id == worker_id and job.cancel_requested:

        def cancel() -> None:
            with sessions() as s:
                state.mark_cancelled(s, job_id, worker_id=worker_id)

        retry_db(cancel, f"cancellation of job {job_id}", budget_s)
        log.info("job %s: cancelled (%s)", job_id, why)
        return Outcome("cancelled", why)
    log.warning(
        "job %s: stopped because this worker no longer owns it (now %s)", job_id, job.status
    )
    return Outcome("lost", why)
