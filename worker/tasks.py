"""Thin, named, idempotent Celery tasks: they take ids and call the runner / the sweep.

Retries: none at the Celery level. Bad input fails the job permanently (the runner records
it). A pool process that dies mid-job (killed, out of memory) is seen at once by the worker's
main process (WorkerLostError): JobRequest puts the job back in the queue (bounded attempts)
before Celery returns the message to the broker, so the job runs again within seconds. A
whole worker that dies is handled by the heartbeat sweep, also with bounded attempts.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery.worker.request import Request

from app.jobs import state
from app.settings import TASK_NAME
from worker.celery_app import SWEEP_TASK, app, detect_device, sessions_for, sweep_once
from worker.dbretry import retry_db

log = logging.getLogger("worker.tasks")

# The main process does this write inline (its consumer waits): a short budget; if the
# database is away longer, the heartbeat sweep re-queues the job later.
LOST_DB_RETRY_S = 10.0


def _exception(exc_info: Any) -> BaseException | None:
    exc = getattr(exc_info, "exception", None)
    return getattr(exc, "exc", exc)  # celery wraps some in ExceptionWithTraceback


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
        # The runner's worker id in the pool process that ran it (runner.default_worker_id).
        owner = f"{socket.gethostname()}:{self.worker_pid}"
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


def run_job(job_id: str) -> str:
    """Run one attempt of the job (a no-op when it is not queued). Returns the outcome."""
    from worker.runner import RunnerConfig
    from worker.runner import run_job as run

    settings = app.conf.higgs_settings
    cfg = RunnerConfig.from_settings(settings, detect_device(settings.device))
    outcome = run(sessions_for(settings), job_id, cfg)
    log.info("job %s: %s %s", job_id, outcome.status, outcome.detail)
    return outcome.status


def sweep() -> dict[str, list[str]]:
    """Re-queue lost jobs and re-send jobs that never reached the broker."""
    return sweep_once(app.conf.higgs_settings)


run_job_task = app.task(name=TASK_NAME, acks_late=True, ignore_result=True, Request=JobRequest)(
    run_job
)
sweep_task = app.task(name=SWEEP_TASK, ignore_result=True, soft_time_limit=120, time_limit=180)(
    sweep
)
