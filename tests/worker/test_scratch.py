"""Scratch of job attempts (worker.scratch) against a real database and the real runner: the
sweep removes the folders of attempts that no longer run and counts them on the job; a running
attempt past its key's disk quota fails cleanly; a submit of a key at its quota is refused."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.db.models import Artifact, Job
from app.jobs import state
from app.jobs.disk import DiskQuotaExceededError, key_disk_usage
from app.jobs.schemas import JobCreate
from app.jobs.service import create_job, job_view, validate_request
from app.keys.service import AuthKey, create_key
from app.settings import Settings
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import files_under
from tests.worker.helpers import create_job as create_job_row
from worker.config import RunnerConfig
from worker.runner import run_job
from worker.scratch import TRASH_GRACE_S, sweep_scratch
from worker.staging import STAGING
from worker.sweep import sweep

BODY = {"model": {"id": MODEL}, "target": {"bits": 4}}


def _folder(root: Path, name: str, nbytes: int) -> Path:
    d = root / STAGING / name
    (d / "out").mkdir(parents=True)
    (d / "out" / "model.safetensors").write_bytes(b"x" * nbytes)
    return d


def _job(sessions: sessionmaker[Session], job_id: str) -> Job:
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        s.expunge(job)
        return job


def test_the_sweep_removes_scratch_of_attempts_that_no_longer_run(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    root = settings.artifacts_path
    job_id = create_job_row(sessions, settings, BODY)
    with sessions() as s:
        assert state.claim(s, job_id, "w1") is not None  # attempt 1 runs
    live = _folder(root, f"{job_id}.1.aaaaaaaa", 1000)
    live_part = _folder(root, f"{job_id}-part0.1.bbbbbbbb", 10)  # no running part row
    earlier = _folder(root, f"{job_id}.0.cccccccc", 300)  # an attempt before this one
    trash = _folder(root, f".trash-{job_id}.0.dddddddd-eeeeeeee", 7)
    young_trash = _folder(root, f".trash-{job_id}.0.ffffffff-00000000", 5)
    old = time.time() - TRASH_GRACE_S - 5
    os.utime(trash, (old, old))
    unknown = _folder(root, "not-an-attempt", 3)

    out = sweep_scratch(sessions, root)
    assert live.exists() and young_trash.exists() and unknown.exists()
    assert not earlier.exists() and not live_part.exists() and not trash.exists()
    assert out.bytes_by_job == {job_id: 310, "": 7}
    assert _job(sessions, job_id).scratch_reclaimed_bytes == 310

    # The attempt dies (its job failed): the whole sweep takes its folder too.
    with sessions() as s:
        state.fail(s, job_id, "worker_lost", "the worker stopped beating", worker_id="w1")
    result = sweep(sessions, settings, lambda _: True)
    assert result.scratch == [live.name]
    assert not live.exists()
    job = _job(sessions, job_id)
    assert job.scratch_reclaimed_bytes == 1310
    error = job_view(job).error
    assert error is not None and error.scratch_reclaimed_bytes == 1310


def test_a_running_job_past_its_keys_disk_quota_fails_cleanly(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    job_id = create_job_row(sessions, settings, BODY)
    cfg = dataclasses.replace(runner_cfg, disk_quota_bytes_per_key=1)  # no layer delay
    outcome = run_job(sessions, job_id, cfg)
    assert outcome.status == "failed", outcome
    job = _job(sessions, job_id)
    assert (job.status, job.error_code) == ("failed", "disk_quota_exceeded")
    assert (
        job.error_message is not None and "HIGGS_DISK_QUOTA_BYTES_PER_KEY = 1" in job.error_message
    )
    assert job.scratch_reclaimed_bytes is not None and job.scratch_reclaimed_bytes > 0
    assert files_under(settings.artifacts_path) == []


def test_a_key_at_its_disk_quota_cannot_submit(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    spec = validate_request(JobCreate.model_validate(BODY), settings)
    with sessions() as s:
        row, _ = create_key(s, "full")
        key = AuthKey.of(row)
        job, _ = create_job(s, key, spec, "first", disk_quota=1000)
        s.add(
            Artifact(
                job_id=job.id, format="native", uri="file:///x", total_bytes=600, sha256="0" * 64
            )
        )
        running, _ = create_job(s, key, spec, None, disk_quota=1000)
        s.commit()
    with sessions() as s:
        state.claim(s, running.id, "w1")
        s.get(Job, running.id).scratch_bytes = 400  # type: ignore[union-attr]
        s.commit()
        assert key_disk_usage(s, key.id) == 1000
        with pytest.raises(DiskQuotaExceededError, match="disk quota is 1000 bytes"):
            create_job(s, key, spec, None, disk_quota=1000)
        # A replay of an existing job is still answered; another key is not affected.
        assert create_job(s, key, spec, "first", disk_quota=1000)[1] is False
        other, _ = create_key(s, "empty")
        assert create_job(s, AuthKey.of(other), spec, None, disk_quota=1000)[1] is True
        create_job(s, key, spec, None, disk_quota=0)  # no quota
