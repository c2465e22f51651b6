"""One job attempt's bookkeeping, shared by the runner (worker.runner) and the fan-out
(worker.fanout): the claim (compare-and-set queued -> running) and the claimed record, the
attempt's outcome, and how a failure, a stop or the success is recorded (its progress and
heartbeats: worker.progress; its files: worker.publish). Every database write is retried
through an outage (worker.dbretry)."""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from app.db.models import CANCELLED, FAILED, RUNNING, SUCCEEDED, Job
from app.jobs import state
from app.jobs.rows import ArtifactRow
from higgs_engine.errors import HiggsError
from worker.config import RunnerConfig
from worker.dbretry import DatabaseUnavailableError, SessionFactory, retry_db
from worker.messages import message_roots, public_message
from worker.progress import ProgressWriter
from worker.scratch import DiskQuotaError

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


def job_error_code(exc: BaseException) -> str:
    """The job's error code for an exception escaping the engine."""
    if isinstance(exc, HiggsError):
        return exc.code if exc.code in ENGINE_CODES else "engine_error"
    if isinstance(exc, DiskQuotaError):
        return exc.code
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


# ---------------------------------------------------------------- the attempt


# How an attempt (of a job, a part or an assembly) ended; what the Celery tasks return.
OutcomeStatus = Literal[
    "succeeded",  # published (a job or an assembly), or a part's shards stored
    "failed",  # the job failed with an error code (detail: "code: message")
    "cancelled",  # the user's cancel was recorded
    "lost",  # this worker no longer owns the work, or the database stayed away
    "skipped",  # nothing to claim (a duplicate delivery, finished, or not all parts done)
    "fanned_out",  # the job's parts were recorded and dispatched (worker.fanout)
    "storage_full",  # the artifacts volume is full: the job waits in the queue
    "storage_unavailable",  # the artifact store cannot be used: back in the queue
]


@dataclass
class Outcome:
    status: OutcomeStatus
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


def record_success(
    attempt: Attempt, report: Any, rows: list[ArtifactRow], model_revision: str | None
) -> None:
    """The job succeeded with its report, layer and artifact rows: one transaction (retried
    while the database is away; a retry after a commit whose reply was lost is no error)."""
    sessions, job_id, worker_id, cfg = (
        attempt.sessions,
        attempt.job_id,
        attempt.worker_id,
        attempt.cfg,
    )
    report_dict = json.loads(json.dumps(report.to_dict()))  # plain JSON types only
    tries = 0

    def record() -> None:
        nonlocal tries
        tries += 1
        try:
            with sessions() as s:
                state.succeed(
                    s,
                    job_id,
                    report_dict,
                    None,
                    rows,
                    worker_id=worker_id,
                    model_revision=model_revision,
                )
        except state.IllegalTransitionError:
            # A retry after a commit whose reply was lost finds the job already ours.
            if tries > 1 and ours_now(sessions, job_id, worker_id, SUCCEEDED, cfg.db_retry_s):
                return
            raise

    retry_db(record, f"result of job {job_id}", cfg.db_retry_s)
