"""Thin, named, idempotent Celery tasks: they take ids and call the runner / the sweep.

Retries: none at the Celery level. Bad input fails the job permanently (the runner records
it). A pool process that dies mid-job (killed, out of memory) is seen at once by the worker's
main process (WorkerLostError): JobRequest puts the job back in the queue (bounded attempts)
before Celery returns the message to the broker, so the job runs again within seconds. A
whole worker that dies is handled by the heartbeat sweep, also with bounded attempts.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery.worker.request import Request

from app.jobs import parts, state
from app.settings import TASK_NAME
from worker.attempt import OutcomeStatus, worker_id_of
from worker.celery_app import (
    ASSEMBLE_TASK,
    PART_TASK,
    SWEEP_TASK,
    app,
    detect_device,
    sessions_for,
    sweep_once,
)
from worker.dbretry import retry_db
from worker.limits import memory_limit
from worker.staging import clear_stale_staging

log = logging.getLogger("worker.tasks")

# The job's error code when its pool process crashed in native code (docs/api.md).
NATIVE_CRASH = "native_crash"

# The main process does this write inline (its consumer waits): a short budget; if the
# database is away longer, the heartbeat sweep re-queues the job later.
LOST_DB_RETRY_S = 10.0


def _exception(exc_info: Any) -> BaseException | None:
    exc = getattr(exc_info, "exception", None)
    return getattr(exc, "exc", exc)  # celery wraps some in ExceptionWithTraceback


# Signals of a process that crashed in its own code (not killed from outside: SIGKILL from the
# OOM killer or an operator, SIGTERM at shutdown are lost workers, retried).
_CRASH_SIGNALS = {4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 11: "SIGSEGV"}


def native_crash(exc: BaseException | None, max_memory_mb: int) -> str | None:
    """The job's error message when its pool process crashed in native code (billiard's
    WorkerLostError "...exited prematurely: signal 6 (SIGABRT)..."), else None."""
    if not isinstance(exc, WorkerLostError):
        return None
    m = re.search(r"signal (\d+)", str(exc))
    if m is None or int(m.group(1)) not in _CRASH_SIGNALS:
        return None
    sig = int(m.group(1))
    return (
        f"the worker process running the job crashed in native code (signal {sig}, "
        f"{_CRASH_SIGNALS[sig]}): an assertion or fault in llama.cpp or torch on this model, "
        f"or an allocation past the memory limit (HIGGS_WORKER_MAX_MEMORY_MB={max_memory_mb}); "
        "the job is not retried"
    )


class JobRequest(Request):
    """The run_job request as the worker's main process sees it."""

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        try:
            self._release_job(_exception(exc_info))
        except (
            Exception
        ) as e:  # never let bookkeeping break the consumer; the sweep is the backstop
            log.warning("could not release the job of lost task %s: %s", self.id, e)
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )

    def _release_job(self, exc: BaseException | None) -> None:
        if isinstance(exc, (SystemExit, KeyboardInterrupt)):
            if getattr(self, "_already_cancelled", False) or getattr(
                self, "_already_revoked", False
            ):
                return
            lost = True  # celery treats this as a lost worker too
        else:
            lost = isinstance(exc, WorkerLostError)
        timed_out = isinstance(exc, TimeLimitExceeded)
        if not (lost or timed_out) or self.worker_pid is None or not self.args:
            return
        job_id = str(self.args[0])
        owner = worker_id_of(self.worker_pid)  # the runner's worker id in that pool process
        settings = app.conf.higgs_settings
        sessions = sessions_for(settings)
        if timed_out:
            message = f"the job ran past the hard time limit ({settings.job_time_limit_s}s) and was stopped"

            def fail() -> None:
                with sessions() as s:
                    state.fail(s, job_id, "time_limit", message, worker_id=owner)

            try:
                retry_db(fail, f"time limit of job {job_id}", LOST_DB_RETRY_S)
            except state.IllegalTransitionError:
                return
            log.error("job %s: %s", job_id, message)
            return
        crash = native_crash(exc, settings.worker_max_memory_mb)
        if crash is not None:
            # A crash inside native code (llama.cpp's GGML_ASSERT, a segfault) would crash
            # every attempt the same way: the job fails once, with that code.
            def fail_crash() -> None:
                with sessions() as s:
                    state.fail(s, job_id, NATIVE_CRASH, crash, worker_id=owner)

            try:
                retry_db(fail_crash, f"crash of job {job_id}", LOST_DB_RETRY_S)
            except state.IllegalTransitionError:
                return
            clear_stale_staging(settings.artifacts_path, job_id)  # what the attempt staged
            log.error("job %s: %s", job_id, crash)
            return
        reason = f"the worker process running it died ({exc})"

        def release() -> str | None:
            with sessions() as s:
                return state.release_lost(s, job_id, owner, settings.max_attempts, reason)

        status = retry_db(release, f"release of lost job {job_id}", LOST_DB_RETRY_S)
        if status is not None:
            log.warning(
                "job %s: its pool process %s died (%s); job now %s",
                job_id,
                self.worker_pid,
                exc,
                status,
            )


class PartRequest(Request):
    """The run_part request as the worker's main process sees it: a pool process that died
    puts its part back in the queue at once (bounded attempts), as JobRequest does for jobs."""

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        try:
            self._release_part(_exception(exc_info))
        except Exception as e:  # the part sweep is the backstop
            log.warning("could not release the part of lost task %s: %s", self.id, e)
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )

    def _release_part(self, exc: BaseException | None) -> None:
        timed_out = isinstance(exc, TimeLimitExceeded)
        lost = isinstance(exc, (WorkerLostError, SystemExit, KeyboardInterrupt))
        if not (lost or timed_out) or self.worker_pid is None or len(self.args) < 3:
            return
        job_id, attempt, idx = str(self.args[0]), int(self.args[1]), int(self.args[2])
        owner = worker_id_of(self.worker_pid)
        settings = app.conf.higgs_settings
        sessions = sessions_for(settings)
        if timed_out:
            message = f"the part ran past the hard time limit ({settings.job_time_limit_s}s)"

            def fail() -> bool:
                with sessions() as s:
                    return parts.fail_part(s, job_id, attempt, idx, owner, "time_limit", message)

            retry_db(fail, f"time limit of job {job_id} part {idx}", LOST_DB_RETRY_S)
            return
        reason = f"the worker process running it died ({exc})"

        def release() -> str | None:
            with sessions() as s:
                return parts.release_lost_part(
                    s, job_id, attempt, idx, owner, settings.max_attempts, reason
                )

        status = retry_db(release, f"release of job {job_id} part {idx}", LOST_DB_RETRY_S)
        if status is not None:
            log.warning(
                "job %s part %d: its pool process died (%s); part now %s", job_id, idx, exc, status
            )


def _runner_config() -> Any:
    from worker.config import RunnerConfig

    settings = app.conf.higgs_settings
    return RunnerConfig.from_settings(settings, detect_device(settings.device))


def dispatch_parts(job_id: str, attempt: int, idxs: list[int]) -> bool:
    """Send a fanned-out job's parts as a group with its assembly as the chord's callback
    (counted on the Redis result backend). False when the broker cannot be reached."""
    from celery import chord, group

    try:
        chord(group(run_part_task.si(job_id, attempt, i) for i in idxs))(
            assemble_task.s(job_id, attempt)
        )
    except Exception as e:  # the sweep sends unsent parts and the assembly (its barrier)
        log.warning("could not send the parts of job %s: %s", job_id, e)
        return False
    return True


def fanout_dispatch() -> Any:
    """dispatch_parts when this worker can fan out (HIGGS_FANOUT with a Redis broker, whose
    result backend counts the chord), else None (sharded sources run on one worker)."""
    settings = app.conf.higgs_settings
    return dispatch_parts if settings.fanout and app.conf.result_backend else None


def run_job(job_id: str) -> OutcomeStatus:
    """Run one attempt of the job (a no-op when it is not queued). Returns the outcome."""
    from worker.runner import run_job as run

    settings = app.conf.higgs_settings
    cfg = _runner_config()
    with memory_limit(settings.worker_max_memory_mb, cfg.device):
        outcome = run(sessions_for(settings), job_id, cfg, dispatch=fanout_dispatch())
    log.info("job %s: %s %s", job_id, outcome.status, outcome.detail)
    return outcome.status


def run_part(job_id: str, attempt: int, idx: int) -> OutcomeStatus:
    """Run one attempt of one part of a fanned-out job (a no-op when it is not queued)."""
    from worker.fanout import run_part as run

    settings = app.conf.higgs_settings
    cfg = _runner_config()
    with memory_limit(settings.worker_max_memory_mb, cfg.device):
        outcome = run(sessions_for(settings), job_id, int(attempt), int(idx), cfg)
    log.info("job %s part %s: %s %s", job_id, idx, outcome.status, outcome.detail)
    return outcome.status


def assemble(results: Any, job_id: str, attempt: int) -> OutcomeStatus:
    """Assemble a fanned-out job once every part is done (the chord's callback; the sweep
    sends it too, with results None). A no-op when the parts are not all done."""
    from worker.fanout import assemble as run

    settings = app.conf.higgs_settings
    # The chord passes its parts' results; the sweep's barrier sends None.
    trigger = "sweep" if results is None else "chord"
    cfg = _runner_config()
    with memory_limit(settings.worker_max_memory_mb, cfg.device):
        outcome = run(sessions_for(settings), job_id, int(attempt), cfg, trigger=trigger)
    log.info("job %s assembly (%s): %s %s", job_id, trigger, outcome.status, outcome.detail)
    return outcome.status


def sweep() -> dict[str, list[str]]:
    """Re-queue lost jobs and re-send jobs that never reached the broker."""
    return sweep_once(app.conf.higgs_settings)


run_job_task = app.task(name=TASK_NAME, acks_late=True, ignore_result=True, Request=JobRequest)(
    run_job
)
# Parts keep their result (ignore_result=False): the chord counts them on the result backend.
run_part_task = app.task(name=PART_TASK, acks_late=True, ignore_result=False, Request=PartRequest)(
    run_part
)
assemble_task = app.task(name=ASSEMBLE_TASK, acks_late=True, ignore_result=True)(assemble)
sweep_task = app.task(name=SWEEP_TASK, ignore_result=True, soft_time_limit=120, time_limit=180)(
    sweep
)
