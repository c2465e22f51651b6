"""Thin, named, idempotent Celery tasks: they take ids and call the runner / the sweep.

Retries: none at the Celery level. Bad input fails the job permanently (the runner records
it); a worker that dies is handled by late acks and the heartbeat sweep, with bounded attempts.
"""

from __future__ import annotations

import logging

from app.settings import TASK_NAME
from worker.celery_app import SWEEP_TASK, app, detect_device, sessions_for, sweep_once

log = logging.getLogger("worker.tasks")


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


run_job_task = app.task(name=TASK_NAME, acks_late=True, ignore_result=True)(run_job)
sweep_task = app.task(name=SWEEP_TASK, ignore_result=True, soft_time_limit=120, time_limit=180)(sweep)
