"""Helpers of the worker tests: jobs created through the API's own service functions, a poll
loop, and a runner attempt cancelled in the middle."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")


def create_job(
    sessions: sessionmaker[Session], settings: Any, body: dict[str, Any], key_name: str = "test"
) -> str:
    """Insert a job exactly as POST /v1/jobs does (validation + row), without HTTP."""
    from app.jobs.schemas import JobCreate
    from app.jobs.service import create_job as create
    from app.jobs.service import validate_request
    from app.keys.service import AuthKey, create_key

    with sessions() as s:
        key, _ = create_key(s, key_name)
        spec = validate_request(JobCreate.model_validate(body), settings)
        job, _ = create(s, AuthKey.of(key), spec, None)
        return job.id


def job_row(sessions: sessionmaker[Session], job_id: str) -> Any:
    """The job's row with its artifacts (and their files) and layers loaded, detached."""
    from app.db.models import Job

    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        _ = job.artifacts, job.layers, [a.files for a in job.artifacts]
        s.expunge_all()
        return job


def wait_until(cond: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def cancel_mid_run(
    sessions: sessionmaker[Session],
    job_id: str,
    run: Callable[[], Any],
    ready: Callable[[], Any],
    what: str,
    timeout: float = 60,
) -> Any:
    """Run `run()` (one runner attempt) in a thread, request cancellation once `ready()` holds,
    and return the attempt's outcome after the runner stopped."""
    import threading

    from app.jobs import state

    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(run()))
    t.start()
    try:
        wait_until(ready, timeout, what)
        with sessions() as s:
            state.request_cancel(s, job_id)
    finally:
        t.join(60)
    assert not t.is_alive(), "the runner did not stop after the cancel request"
    assert result, "the runner thread raised"
    return result[0]
