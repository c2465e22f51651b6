"""Every job transition of app.jobs.state, legal and illegal, on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.manifest import manifest_sha256
from app.db.base import utcnow
from app.db.models import Artifact, ArtifactFile, Job, JobLayer
from app.jobs import state
from app.jobs.rows import ArtifactRow, FileRow, InvalidRowError
from tests.app.factories import make_job, make_key

SHA = "ab" * 32
REPORT = {
    "bits_per_weight": 4.125,
    "bits_per_param_total": 5.0,
    "bytes_before": 1000,
    "bytes_after": 300,
    "layers": [
        {
            "name": "l0",
            "shape": [8, 16],
            "p": 2,
            "n": 256,
            "bits": 4.06,
            "rel_error": 0.01,
            "bytes": 70,
        },
        {
            "name": "l1",
            "shape": [16, 8],
            "p": 0,
            "n": 0,
            "bits": 16.0,
            "rel_error": 0.0,
            "bytes": 256,
        },
    ],
    "metrics": {"ppl_base": 10.0, "ppl_quantized": 10.5},
}


@pytest.fixture
def s(sessions: sessionmaker[Session]) -> Iterator[Session]:
    with sessions() as session:
        yield session


@pytest.fixture
def key_id(s: Session) -> str:
    return make_key(s)[0].id


def artifact(tmp_path, fmt: str = "native", path: str = "a.bin", sha: str = SHA) -> ArtifactRow:
    return ArtifactRow(
        format=fmt,
        uri=(tmp_path / fmt).as_uri(),
        files=(FileRow(path, 3, sha),),
        total_bytes=3,
        sha256=manifest_sha256([(path, sha)]),
    )


def test_claim_is_compare_and_set(s: Session, key_id: str) -> None:
    job = make_job(s, key_id)
    claimed = state.claim(s, job.id, "w1")
    assert claimed is not None
    assert (claimed.status, claimed.attempts, claimed.worker_id) == ("running", 1, "w1")
    assert claimed.started_at is not None and claimed.heartbeat_at is not None
    # A duplicate delivery finds nothing to claim.
    assert state.claim(s, job.id, "w2") is None
    assert state.claim(s, "no-such-job", "w2") is None


def test_record_progress_heartbeat_and_cancel_flag(s: Session, key_id: str) -> None:
    job = make_job(s, key_id)
    state.claim(s, job.id, "w1")
    assert state.record_progress(s, job.id, "loading", 0, 1, worker_id="w1") is True
    assert state.record_progress(s, job.id, "quantizing", 3, 10, worker_id="w1") is True
    row = s.get(Job, job.id, populate_existing=True)
    assert row is not None
    assert (row.stage, row.progress_done, row.progress_total) == ("quantizing", 3, 10)
    assert "loading" in (row.stage_durations or {})
    # Another worker (the job was requeued and re-claimed elsewhere) is told to stop.
    assert state.record_progress(s, job.id, "quantizing", 4, 10, worker_id="other") is False
    assert state.heartbeat(s, job.id, worker_id="w1") is True
    state.request_cancel(s, job.id)
    assert state.record_progress(s, job.id, "quantizing", 5, 10, worker_id="w1") is False
    assert state.heartbeat(s, job.id) is False
    with pytest.raises(state.JobNotFoundError):
        state.record_progress(s, "nope", "loading", 0, 1)


def test_progress_on_queued_job_is_refused(s: Session, key_id: str) -> None:
    job = make_job(s, key_id)
    assert state.record_progress(s, job.id, "loading", 0, 1) is False


def test_succeed_stores_report_layers_artifacts_in_one_go(
    s: Session, key_id: str, tmp_path
) -> None:
    job = make_job(s, key_id)
    state.claim(s, job.id, "w1")
    state.record_progress(s, job.id, "quantizing", 2, 2, worker_id="w1")
    done = state.succeed(
        s,
        job.id,
        REPORT,
        None,
        [artifact(tmp_path), artifact(tmp_path, "dequantized")],
        worker_id="w1",
        model_revision="abc123",
    )
    assert done.status == "succeeded" and done.finished_at is not None
    assert done.model_revision == "abc123"
    assert done.summary is not None and done.summary["bits_per_weight"] == 4.125
    assert done.summary["ppl_quantized"] == 10.5 and done.summary["kl"] is None
    assert done.report == REPORT
    assert "quantizing" in (done.stage_durations or {})
    layers = s.scalars(
        select(JobLayer).where(JobLayer.job_id == job.id).order_by(JobLayer.idx)
    ).all()
    assert [(r.name, r.p, r.n) for r in layers] == [("l0", 2, 256), ("l1", 0, 0)]
    arts = s.scalars(select(Artifact).where(Artifact.job_id == job.id)).all()
    assert sorted(a.format for a in arts) == ["dequantized", "native"]
    assert all(a.total_bytes == 3 and len(a.sha256) == 64 for a in arts)
    # Illegal afterwards: every other transition.
    for call in (
        lambda: state.succeed(s, job.id, REPORT, [], []),
        lambda: state.fail(s, job.id, "x", "y"),
        lambda: state.request_cancel(s, job.id),
        lambda: state.mark_cancelled(s, job.id),
    ):
        with pytest.raises(state.IllegalTransitionError) as e:
            call()
        assert e.value.status == 409 and e.value.job_status == "succeeded"


def test_predicted_ppl_increase_is_a_dynamic_targets_figure(s: Session, key_id: str) -> None:
    """A uniform job on a model with a cached profile gets the prediction in its report
    (metrics, from the layers' measured errors), but its summary says null, as documented:
    only a dynamic target (whose report names the target) has a predicted_ppl_increase."""
    metrics: dict[str, Any] = {
        "ppl_base": 10.0,
        "ppl_quantized": 10.5,
        "predicted_ppl_increase": 0.031,
    }
    annotated = {**REPORT, "metrics": metrics}
    uniform = make_job(s, key_id)
    state.claim(s, uniform.id, "w1")
    done = state.succeed(s, uniform.id, annotated, worker_id="w1")
    assert done.summary is not None and done.summary["predicted_ppl_increase"] is None
    assert done.report is not None and done.report["metrics"]["predicted_ppl_increase"] == 0.031

    dynamic_report = {**REPORT, "metrics": {**metrics, "target": {"avg_bits": 3.5}}}
    dynamic = make_job(s, key_id)
    state.claim(s, dynamic.id, "w1")
    done = state.succeed(s, dynamic.id, dynamic_report, worker_id="w1")
    assert done.summary is not None and done.summary["predicted_ppl_increase"] == 0.031


def test_succeed_rejects_bad_rows_and_changes_nothing(s: Session, key_id: str, tmp_path) -> None:
    job = make_job(s, key_id)
    state.claim(s, job.id, "w1")
    bad_path = artifact(tmp_path, path="../etc/passwd")
    bad_sha = artifact(tmp_path, sha="xyz")
    relative_root = dataclasses.replace(artifact(tmp_path), uri="relative/dir")
    for rows in ([bad_path], [bad_sha], [relative_root]):
        with pytest.raises(InvalidRowError):
            state.succeed(s, job.id, REPORT, None, rows)
    with pytest.raises(InvalidRowError):  # the report's layer rows are checked too
        state.succeed(s, job.id, {**REPORT, "layers": [{"name": "x"}]}, None, [])
    row = s.get(Job, job.id, populate_existing=True)
    assert row is not None and row.status == "running"
    assert s.scalar(select(func.count()).select_from(ArtifactFile)) == 0


def test_succeed_by_wrong_worker_or_after_cancel_request(s: Session, key_id: str, tmp_path) -> None:
    job = make_job(s, key_id)
    with pytest.raises(state.IllegalTransitionError):
        state.succeed(s, job.id, REPORT, [], [])  # still queued
    state.claim(s, job.id, "w1")
    with pytest.raises(state.IllegalTransitionError):
        state.succeed(s, job.id, REPORT, [], [], worker_id="w2")
    state.request_cancel(s, job.id)
    with pytest.raises(state.JobCancelRequestedError):
        state.succeed(s, job.id, REPORT, [], [artifact(tmp_path)], worker_id="w1")
    assert s.scalar(select(func.count()).select_from(Artifact)) == 0
    cancelled = state.mark_cancelled(s, job.id, worker_id="w1")
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    assert state.mark_cancelled(s, job.id).status == "cancelled"  # idempotent


def test_fail(s: Session, key_id: str) -> None:
    job = make_job(s, key_id)
    with pytest.raises(state.IllegalTransitionError):
        state.fail(s, job.id, "model_not_found", "nope")  # queued jobs are not failed
    state.claim(s, job.id, "w1")
    with pytest.raises(state.IllegalTransitionError):
        state.fail(s, job.id, "boom", "msg", worker_id="w2")
    failed = state.fail(s, job.id, "model_not_found", "model 'x' not found " + "y" * 5000)
    assert (failed.status, failed.error_code) == ("failed", "model_not_found")
    assert failed.error_message is not None and len(failed.error_message) == state.MAX_MESSAGE_CHARS
    with pytest.raises(state.IllegalTransitionError):
        state.claim(s, job.id, "w1") or state.fail(s, job.id, "x", "y")
    with pytest.raises(state.JobNotFoundError):
        state.fail(s, "missing", "x", "y")


def test_request_cancel_queued_running_finished(s: Session, key_id: str) -> None:
    queued = make_job(s, key_id)
    c = state.request_cancel(s, queued.id)
    assert c.status == "cancelled" and c.cancel_requested and c.finished_at is not None
    assert state.claim(s, queued.id, "w1") is None  # a late delivery finds nothing
    with pytest.raises(state.IllegalTransitionError):
        state.request_cancel(s, queued.id)

    running = make_job(s, key_id)
    state.claim(s, running.id, "w1")
    r = state.request_cancel(s, running.id)
    assert r.status == "running" and r.cancel_requested
    assert state.request_cancel(s, running.id).cancel_requested  # repeated request is fine
    with pytest.raises(state.JobNotFoundError):
        state.request_cancel(s, "missing")


def test_mark_cancelled_from_queued_and_wrong_worker(s: Session, key_id: str) -> None:
    job = make_job(s, key_id)
    state.claim(s, job.id, "w1")
    with pytest.raises(state.IllegalTransitionError):
        state.mark_cancelled(s, job.id, worker_id="w2")
    assert state.mark_cancelled(s, job.id, worker_id="w1").status == "cancelled"
    queued = make_job(s, key_id)
    assert state.mark_cancelled(s, queued.id).status == "cancelled"


def test_requeue_stale_requeues_then_fails_after_max_attempts(s: Session, key_id: str) -> None:
    job = make_job(s, key_id)
    fresh = make_job(s, key_id)
    state.claim(s, job.id, "w1")
    state.claim(s, fresh.id, "w2")
    state.mark_enqueued(s, job.id)  # no-op: running
    later = utcnow() + timedelta(seconds=100)
    # Nothing is stale within the timeout.
    assert state.requeue_stale(s, later, 1000, 2) == state.StaleSweep()
    # Both heartbeats are 100 s old; `fresh` beats again just before the sweep.
    state.heartbeat(s, fresh.id)
    sweep = state.requeue_stale(s, utcnow() + timedelta(seconds=0.5), timedelta(seconds=0.1), 2)
    assert set(sweep.requeued) == {job.id, fresh.id} and sweep.failed == []

    row = s.get(Job, job.id, populate_existing=True)
    assert row is not None
    assert (row.status, row.worker_id, row.enqueued_at, row.attempts) == ("queued", None, None, 1)
    assert job.id in state.list_unenqueued(s, utcnow() + timedelta(seconds=1))

    # Second attempt dies too: max_attempts=2 reached -> failed with worker_lost.
    state.claim(s, job.id, "w3")
    sweep = state.requeue_stale(s, utcnow() + timedelta(seconds=10), 5, 2)
    assert job.id in sweep.failed
    row = s.get(Job, job.id, populate_existing=True)
    assert row is not None and (row.status, row.error_code) == ("failed", "worker_lost")
    assert row.error_message and "attempt 2 of 2" in row.error_message


def test_requeue_stale_cancels_when_cancel_was_requested(s: Session, key_id: str) -> None:
    job = make_job(s, key_id)
    state.claim(s, job.id, "w1")
    state.request_cancel(s, job.id)
    sweep = state.requeue_stale(s, utcnow() + timedelta(seconds=10), 5, 3)
    assert sweep.cancelled == [job.id]
    row = s.get(Job, job.id, populate_existing=True)
    assert row is not None and row.status == "cancelled"


def test_list_unenqueued_and_mark_enqueued(s: Session, key_id: str) -> None:
    old = make_job(s, key_id, age_s=120)
    young = make_job(s, key_id)
    sent = make_job(s, key_id, age_s=120)
    assert state.mark_enqueued(s, sent.id) is True
    ids = state.list_unenqueued(s, utcnow() - timedelta(seconds=30))
    assert ids == [old.id]
    assert young.id not in ids
    state.claim(s, old.id, "w")
    assert state.mark_enqueued(s, old.id) is False
    assert state.list_unenqueued(s, utcnow() - timedelta(seconds=30)) == []


def test_record_model_revision(s: Session, key_id: str) -> None:
    job = make_job(s, key_id)
    with pytest.raises(state.IllegalTransitionError):
        state.record_model_revision(s, job.id, "deadbeef")
    state.claim(s, job.id, "w")
    state.record_model_revision(s, job.id, "deadbeef", worker_id="w")
    row = s.get(Job, job.id, populate_existing=True)
    assert row is not None and row.model_revision == "deadbeef"


def test_redelivered_success_replaces_rows(s: Session, key_id: str, tmp_path) -> None:
    """Rows for a job never duplicate, even if a previous attempt wrote some."""
    job = make_job(s, key_id)
    state.claim(s, job.id, "w1")
    s.add(JobLayer(job_id=job.id, idx=0, name="l0", shape=[1, 1], p=2, n=4, bits=1.0, bytes=1))
    s.commit()
    state.succeed(s, job.id, REPORT, None, [artifact(tmp_path)])
    assert s.scalar(select(func.count()).select_from(JobLayer)) == 2
    assert s.scalar(select(func.count()).select_from(Artifact)) == 1


def test_concurrent_claims_have_exactly_one_winner(sessions: sessionmaker[Session]) -> None:
    """Duplicate deliveries racing on one job: the compare-and-set lets one worker through."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    with sessions() as s:
        key_id = make_key(s)[0].id
        job_id = make_job(s, key_id).id
    barrier = threading.Barrier(8)

    def one(i: int) -> bool:
        with sessions() as s:
            barrier.wait()
            return state.claim(s, job_id, f"w{i}") is not None

    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(one, range(8)))
    assert wins.count(True) == 1
    with sessions() as s:
        row = s.get(Job, job_id)
        assert row is not None and row.attempts == 1 and row.worker_id == f"w{wins.index(True)}"
