"""The storage waits of a job attempt: when the local artifacts volume is full
(wait_for_storage) or the artifact store cannot be used (wait_for_store), the job goes back to
the queue with its attempt not counted and the reason recorded (error storage_full or
storage_unavailable); the sweep sends it again once there is room, or once the store answers.
A full volume is told to the operator once until a job is published again
(storage_recovered)."""

from __future__ import annotations

import logging
import time

from app.jobs import state
from worker.attempt import Outcome, stop_job
from worker.config import RunnerConfig
from worker.dbretry import DatabaseUnavailableError, SessionFactory, retry_db
from worker.messages import storage_error_text, volume_free

# A wait's records go out under the runner's logger name, as the rest of the attempt's.
log = logging.getLogger("worker.runner")

# Set while this process has seen the artifacts volume full and no job has succeeded since:
# the operator is told once, not once per job.
_storage_full_since: float | None = None


def storage_recovered() -> None:
    global _storage_full_since
    if _storage_full_since is not None:
        log.info("the artifacts volume has room again (a job was published)")
        _storage_full_since = None


def wait_for_storage(
    sessions: SessionFactory, job_id: str, worker_id: str, cfg: RunnerConfig, exc: BaseException
) -> Outcome:
    """The volume is full: the job goes back to the queue (its attempt not counted) with error
    storage_full; the sweep sends it again once the artifacts volume has more room."""
    global _storage_full_since
    space = volume_free(cfg.artifacts_dir)
    free = None if space is None else space[0]
    shown = "unknown" if free is None else f"{free / 2**20:.1f} MiB"
    message = (
        "the server's storage is full (no space left on device); the job waits in the queue "
        "and runs again once space is freed"
    )
    if _storage_full_since is None:
        _storage_full_since = time.monotonic()
        log.error(
            "storage full: %s (%s free on the artifacts volume %s after cleanup); job %s and any "
            "other job that needs space wait in the queue until space is freed",
            storage_error_text(exc),
            shown,
            cfg.artifacts_dir,
            job_id,
        )
    else:
        log.info("job %s: storage still full; back in the queue", job_id)

    stopped = _back_in_queue(sessions, job_id, worker_id, cfg, state.STORAGE_FULL, message, free)
    return stopped or Outcome("storage_full", message)


def wait_for_store(
    sessions: SessionFactory, job_id: str, worker_id: str, cfg: RunnerConfig, exc: BaseException
) -> Outcome:
    """The artifact store cannot be used: the job goes back to the queue (its attempt not
    counted) with error storage_unavailable; the sweep sends it again once the store answers."""
    where = cfg.store.describe()
    log.error("job %s: artifact store %s unavailable (%s); back in the queue", job_id, where, exc)
    message = (
        "the artifact store cannot be reached; the job waits in the queue and runs again once "
        "it can"
    )

    stopped = _back_in_queue(
        sessions, job_id, worker_id, cfg, state.STORAGE_UNAVAILABLE, message, None
    )
    return stopped or Outcome("storage_unavailable", message)


# What each wait records and, when the job cannot wait (cancel requested meanwhile, or no
# longer ours), the reason it stops with.
_WAITS: dict[str, tuple[str, str]] = {
    state.STORAGE_FULL: ("storage wait", "storage full"),
    state.STORAGE_UNAVAILABLE: ("store wait", "artifact store unavailable"),
}


def _back_in_queue(
    sessions: SessionFactory,
    job_id: str,
    worker_id: str,
    cfg: RunnerConfig,
    code: str,
    message: str,
    free: int | None,
) -> Outcome | None:
    """Record the wait (error `code`, `message`, the free bytes if known) and put the job back
    in the queue: None once it is there, else the attempt's Outcome (lost when nothing could
    be recorded, or stopped)."""
    what, why = _WAITS[code]

    def once() -> bool:
        with sessions() as s:
            return state.wait_for_storage(s, job_id, message, free, worker_id=worker_id, code=code)

    try:
        requeued = retry_db(once, f"{what} of job {job_id}", cfg.db_retry_s)
    except DatabaseUnavailableError as e:
        log.error("job %s: could not record the %s: %s", job_id, what, e)
        return Outcome("lost", str(e))
    if not requeued:  # cancel requested meanwhile, or the job is no longer ours
        return stop_job(sessions, job_id, worker_id, why, cfg.db_retry_s)
    return None
