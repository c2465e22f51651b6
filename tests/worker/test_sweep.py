"""The sweep against a real database and the real server-less (filesystem) broker."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from app.db.base import utcnow
from app.db.models import Job
from app.jobs import state
from app.queue import enqueue_job
from app.settings import TASK_NAME, Settings
from tests.fixtures import TINY_MODEL as MODEL
from tests.worker.helpers import create_job
from worker.config import RunnerConfig
from worker.runner import run_job
from worker.sweep import SweepThread, sweep

BODY = {"model": {"id": MODEL}, "target": {"bits": 4}}


def _broker_messages(settings: Settings) -> list[str]:
    """Job ids of the run_job messages waiting in the filesystem broker."""
    folder = Path(settings.broker_transport_options()["data_folder_in"])
    ids = []
    for p in sorted(folder.glob("*.msg")):
        msg = json.loads(p.read_text())
        if msg["headers"]["task"] == TASK_NAME:
            ids.append(json.loads(_body(msg))[0][0])
    return ids


def _body(msg: dict) -> str:
    import base64

    raw = msg["body"]
    return (
        base64.b64decode(raw).decode()
        if msg["properties"].get("body_encoding") == "base64"
        else raw
    )


def _age_heartbeat(sessions: sessionmaker[Session], job_id: str, seconds: float) -> None:
    with sessions() as s:
        s.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(heartbeat_at=utcnow() - timedelta(seconds=seconds))
        )
        s.commit()


def _get(sessions: sessionmaker[Session], job_id: str) -> Job:
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        s.expunge(job)
        return job


def _send(settings: Settings):
    return lambda job_id: enqueue_job(settings, job_id)


def test_a_job_whose_worker_died_is_requeued_sent_and_then_runs(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    job_id = create_job(sessions, settings, BODY)
    with sessions() as s:
        state.mark_enqueued(s, job_id)
        assert state.claim(s, job_id, "dead-worker") is not None
    # Fresh heartbeat: left alone.
    assert sweep(sessions, settings, _send(settings)).requeued == []
    _age_heartbeat(sessions, job_id, 60)
    result = sweep(sessions, settings, _send(settings))
    assert result.requeued == [job_id] and result.sent == [job_id]
    job = _get(sessions, job_id)
    assert job.status == "queued" and job.enqueued_at is not None and job.worker_id is None
    assert _broker_messages(settings) == [job_id]
    # The redelivered id runs to success on a new worker (attempt 2).
    assert run_job(sessions, job_id, runner_cfg, worker_id="new-worker").status == "succeeded"
    job = _get(sessions, job_id)
    assert job.status == "succeeded" and job.attempts == 2


def test_attempts_are_bounded(settings: Settings, sessions: sessionmaker[Session]) -> None:
    job_id = create_job(sessions, settings, BODY)
    for attempt in range(1, settings.max_attempts + 1):
        with sessions() as s:
            assert state.claim(s, job_id, f"w{attempt}") is not None
        _age_heartbeat(sessions, job_id, 60)
        result = sweep(sessions, settings, _send(settings))
        if attempt < settings.max_attempts:
            assert result.requeued == [job_id]
        else:
            assert result.failed == [job_id] and result.requeued == []
    job = _get(sessions, job_id)
    assert job.status == "failed" and job.error_code == "worker_lost"
    assert str(settings.max_attempts) in (job.error_message or "")


def test_a_job_that_never_reached_the_broker_is_sent(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    job_id = create_job(sessions, settings, BODY)  # committed, but enqueue never happened
    assert _broker_messages(settings) == []
    result = sweep(sessions, settings, _send(settings))
    assert result.sent == [job_id]
    assert _get(sessions, job_id).enqueued_at is not None
    assert _broker_messages(settings) == [job_id]
    # Once marked, the next sweep does not send it again.
    assert sweep(sessions, settings, _send(settings)).sent == []


def test_broker_down_keeps_the_job_for_the_next_sweep(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    job_id = create_job(sessions, settings, BODY)
    result = sweep(sessions, settings, lambda _id: False)
    assert result.send_failed == [job_id] and result.sent == []
    assert _get(sessions, job_id).enqueued_at is None
    assert sweep(sessions, settings, _send(settings)).sent == [job_id]


def test_a_cancel_requested_on_a_dead_job_ends_cancelled(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    job_id = create_job(sessions, settings, BODY)
    with sessions() as s:
        state.claim(s, job_id, "dead")
        state.request_cancel(s, job_id)
    _age_heartbeat(sessions, job_id, 60)
    assert sweep(sessions, settings, _send(settings)).cancelled == [job_id]
    assert _get(sessions, job_id).status == "cancelled"


def test_sweep_thread_runs_until_stopped() -> None:
    import threading

    calls = threading.Semaphore(0)
    thread = SweepThread(lambda _requeue_stale: calls.release(), interval=0.01)
    thread.start()
    for _ in range(3):
        assert calls.acquire(timeout=5)
    thread.stop()
    assert not thread._thread.is_alive()
