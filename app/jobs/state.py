"""THE module that owns every job status transition, used by the API and by the worker.

    queued -> running -> succeeded | failed
    queued | running -> cancelled

Every query runs through app.jobs.repository; this module holds the rules. Every function
here is one transaction: it changes the row with a compare-and-set UPDATE
(`... WHERE status = <expected>`), commits, and raises a typed error when the transition is
illegal, so two processes racing on one job can never both win.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from app.db.base import utcnow
from app.db.models import (
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    Artifact,
    ArtifactFile,
    Job,
    JobLayer,
)
from app.errors import ConflictError, NotFoundError
from app.jobs import repository
from app.jobs.rows import ArtifactRow, InvalidRowError, LayerRow

MAX_MESSAGE_CHARS = 4000
WORKER_LOST = "worker_lost"
STORAGE_FULL = "storage_full"
STORAGE_UNAVAILABLE = "storage_unavailable"
# Error codes of a job back in the queue waiting for storage (room, or a reachable store).
STORAGE_WAITS = (STORAGE_FULL, STORAGE_UNAVAILABLE)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class JobNotFoundError(NotFoundError):
    """No job with this id (for this key): the one not-found error of jobs, 404 job_not_found."""

    code = "job_not_found"

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} does not exist")
        self.job_id = job_id


class IllegalTransitionError(ConflictError):
    """The job is not in a status that allows this transition (e.g. cancel after success)."""

    code = "illegal_transition"

    def __init__(self, job_id: str, status: str, action: str, detail: str | None = None) -> None:
        super().__init__(detail or f"job {job_id} is {status}; cannot {action}")
        self.job_id = job_id
        self.job_status = status
        self.action = action


class JobCancelRequestedError(IllegalTransitionError):
    """succeed() refused: the user asked to cancel. The runner removes what it published and
    calls mark_cancelled()."""

    code = "cancel_requested"


@dataclass
class StaleSweep:
    """What requeue_stale() did, by job id."""

    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)


def _get(session: Session, job_id: str) -> Job:
    job = repository.get(session, job_id)
    if job is None:
        raise JobNotFoundError(job_id)
    return job


_cas = repository.compare_and_set


def _refused(session: Session, job_id: str, action: str) -> IllegalTransitionError:
    session.rollback()
    job = _get(session, job_id)
    session.rollback()
    return IllegalTransitionError(job_id, job.status, action)


def _owned(worker_id: str | None) -> list[ColumnElement[bool]]:
    return [Job.worker_id == worker_id] if worker_id is not None else []


def closed_stage_durations(job: Job, now: datetime) -> dict[str, Any]:
    """stage_durations with the current stage's elapsed time added."""
    durations = dict(job.stage_durations or {})
    if job.stage and job.stage_started_at is not None:
        elapsed = max(0.0, (now - job.stage_started_at).total_seconds())
        durations[job.stage] = round(float(durations.get(job.stage, 0.0)) + elapsed, 6)
    return durations


# ---------------------------------------------------------------- worker side


def claim(session: Session, job_id: str, worker_id: str) -> Job | None:
    """queued -> running (attempts += 1). None when there is nothing to claim: the job is
    running elsewhere, finished, cancelled or unknown (a duplicate delivery simply exits)."""
    now = utcnow()
    ok = _cas(
        session,
        job_id,
        [Job.status == QUEUED, Job.cancel_requested.is_(False)],
        {
            "status": RUNNING,
            "attempts": Job.attempts + 1,
            "worker_id": worker_id,
            "started_at": now,
            "heartbeat_at": now,
            "updated_at": now,
            "stage": None,
            "stage_started_at": None,
            "stage_durations": None,
            "progress_done": 0,
            "progress_total": 0,
            # What a previous attempt left (storage_full while waiting) belongs to it.
            "error_code": None,
            "error_message": None,
            "wait_free_bytes": None,
        },
    )
    if not ok:
        session.rollback()
        return None
    session.commit()
    return _get(session, job_id)


def record_progress(
    session: Session,
    job_id: str,
    stage: str,
    done: int,
    total: int,
    *,
    worker_id: str | None = None,
) -> bool:
    """Write stage, done/total and the heartbeat. Returns False when the job should stop:
    cancel was requested, or the job is no longer running (for this worker, if given)."""
    now = utcnow()
    job = repository.get(session, job_id)
    if job is None:
        session.rollback()
        raise JobNotFoundError(job_id)
    if job.status != RUNNING or (worker_id is not None and job.worker_id != worker_id):
        session.rollback()
        return False
    values: dict[str, Any] = {
        "stage": stage,
        "progress_done": int(done),
        "progress_total": int(total),
        "heartbeat_at": now,
        "updated_at": now,
    }
    if stage != job.stage:
        values["stage_durations"] = closed_stage_durations(job, now)
        values["stage_started_at"] = now
    return _touch_running(session, job_id, worker_id, values)


def heartbeat(session: Session, job_id: str, *, worker_id: str | None = None) -> bool:
    """Refresh heartbeat_at only. Same return value as record_progress."""
    now = utcnow()
    return _touch_running(session, job_id, worker_id, {"heartbeat_at": now, "updated_at": now})


def _touch_running(
    session: Session, job_id: str, worker_id: str | None, values: Mapping[str, Any]
) -> bool:
    """Write `values` on the job if it is running (owned by worker_id, if given) and commit.
    True while the job should go on; False when it is not ours to run or cancel was asked."""
    if not _cas(session, job_id, [Job.status == RUNNING, *_owned(worker_id)], values):
        session.rollback()
        return False
    cancel = repository.cancel_requested(session, job_id)
    session.commit()
    return not cancel


def record_model_revision(
    session: Session, job_id: str, revision: str, *, worker_id: str | None = None
) -> None:
    """Record the resolved model revision (Hub commit sha) on a running job."""
    if not _cas(
        session,
        job_id,
        [Job.status == RUNNING, *_owned(worker_id)],
        {"model_revision": revision, "updated_at": utcnow()},
    ):
        raise _refused(session, job_id, "record the model revision")
    session.commit()


def summary_from_report(report: Mapping[str, Any]) -> dict[str, Any]:
    """The job's `summary` (docs/api.md) from a report.json dict; figures it lacks are null.
    predicted_ppl_increase is a dynamic target's figure: a uniform job on a model with a cached
    profile has one in its report's metrics too (annotate_uniform), but only a report that
    names its dynamic target (metrics.target) puts it in the summary."""
    metrics = report.get("metrics") or {}
    dynamic = isinstance(metrics.get("target"), dict)
    return {
        "bits_per_weight": report.get("bits_per_weight"),
        "bits_per_param_total": report.get("bits_per_param_total"),
        "bytes_before": report.get("bytes_before"),
        "bytes_after": report.get("bytes_after"),
        "ppl_base": metrics.get("ppl_base"),
        "ppl_quantized": metrics.get("ppl_quantized"),
        "kl": metrics.get("kl"),
        "predicted_ppl_increase": metrics.get("predicted_ppl_increase") if dynamic else None,
        # calibrated HIGGS: which text ({source, sha256, tokens}); null for data-free jobs
        "calibration": (
            {k: metrics["calibration"].get(k) for k in ("source", "sha256", "tokens")}
            if isinstance(metrics.get("calibration"), dict)
            else None
        ),
    }


def _check_rel_path(path: str) -> str:
    p = Path(path)
    if (
        not path
        or "\\" in path
        or p.is_absolute()
        or any(part in ("", ".", "..") for part in path.split("/"))
    ):
        raise InvalidRowError(
            f"artifact file path {path!r} must be a relative POSIX path without '..'"
        )
    return path


def _layer_row(job_id: str, idx: int, row: LayerRow) -> JobLayer:
    return JobLayer(
        job_id=job_id,
        idx=idx,
        name=row.name,
        shape=list(row.shape),
        p=row.p,
        n=row.n,
        bits=row.bits,
        rel_error=row.rel_error,
        alpha=row.alpha,
        bytes=row.bytes,
        type=row.type,
    )


def _artifact_row(job_id: str, row: ArtifactRow) -> Artifact:
    files = []
    for f in row.files:
        if not _SHA256.match(f.sha256):
            raise InvalidRowError(f"sha256 {f.sha256!r} of {f.path!r} is not 64 hex digits")
        if f.bytes < 0:
            raise InvalidRowError(f"bytes={f.bytes} of {f.path!r} is negative")
        files.append(ArtifactFile(path=_check_rel_path(f.path), bytes=f.bytes, sha256=f.sha256))
    if not re.match(r"^(file:///|s3://[^/]+/)", row.uri):
        raise InvalidRowError(f"artifact URI {row.uri!r} must be file:///... or s3://bucket/...")
    files.sort(key=lambda f: f.path)
    return Artifact(
        job_id=job_id,
        format=row.format,
        uri=row.uri,
        total_bytes=row.total_bytes,
        sha256=row.sha256,
        files=files,
    )


def succeed(
    session: Session,
    job_id: str,
    report: Mapping[str, Any],
    layers: Sequence[LayerRow] | None = None,
    artifacts: Sequence[ArtifactRow] = (),
    *,
    worker_id: str | None = None,
    model_revision: str | None = None,
    summary: Mapping[str, Any] | None = None,
) -> Job:
    """running -> succeeded, storing the report, per-layer rows and artifact rows in ONE
    transaction. `layers` default to the rows of report["layers"] (LayerRow.from_report); the
    artifact rows come from app.artifacts.manifest.artifact_rows (a local directory's
    file:// URI; the runner names the store's URI after an upload). Raises JobCancelRequestedError when the user asked
    to cancel meanwhile, IllegalTransitionError when the job is not running (for this worker)."""
    now = utcnow()
    job = _get(session, job_id)
    if job.status == RUNNING and job.cancel_requested:
        session.rollback()
        raise JobCancelRequestedError(
            job_id, job.status, "succeed", f"job {job_id} was asked to cancel"
        )
    if job.status != RUNNING or (worker_id is not None and job.worker_id != worker_id):
        session.rollback()
        raise IllegalTransitionError(job_id, job.status, "succeed")
    if layers is None:
        layers = [LayerRow.from_report(i, row) for i, row in enumerate(report.get("layers", []))]
    new_layers = [_layer_row(job_id, i, row) for i, row in enumerate(layers)]
    new_artifacts = [_artifact_row(job_id, row) for row in artifacts]
    values: dict[str, Any] = {
        "status": SUCCEEDED,
        "report": dict(report),
        "summary": dict(summary) if summary is not None else summary_from_report(report),
        "stage_durations": closed_stage_durations(job, now),
        "stage": None,
        "stage_started_at": None,
        "finished_at": now,
        "updated_at": now,
        "heartbeat_at": now,
    }
    if model_revision is not None:
        values["model_revision"] = model_revision
    conditions = [Job.status == RUNNING, Job.cancel_requested.is_(False), *_owned(worker_id)]
    if not _cas(session, job_id, conditions, values):
        session.rollback()
        job = _get(session, job_id)
        session.rollback()
        if job.status == RUNNING and job.cancel_requested:
            raise JobCancelRequestedError(
                job_id, job.status, "succeed", f"job {job_id} was asked to cancel"
            )
        raise IllegalTransitionError(job_id, job.status, "succeed")
    # A redelivered job that got this far before may have left rows: replace, never duplicate.
    repository.replace_rows(session, job_id, new_layers, new_artifacts)
    session.commit()
    return _get(session, job_id)


def fail(
    session: Session, job_id: str, code: str, message: str, *, worker_id: str | None = None
) -> Job:
    """running -> failed with a stable error code and a human message."""
    now = utcnow()
    job = _get(session, job_id)
    values = {
        "status": FAILED,
        "error_code": code[:64],
        "error_message": message[:MAX_MESSAGE_CHARS],
        "stage_durations": closed_stage_durations(job, now),
        "finished_at": now,
        "updated_at": now,
    }
    if not _cas(session, job_id, [Job.status == RUNNING, *_owned(worker_id)], values):
        raise _refused(session, job_id, "fail")
    session.commit()
    return _get(session, job_id)


def _back_to_queue(now: datetime, enqueued_at: datetime | None) -> dict[str, Any]:
    """The column values of a job put back to queued: no worker, no stage, no progress, no
    heartbeat; enqueued_at None lets the sweep send it again."""
    return {
        "status": QUEUED,
        "worker_id": None,
        "stage": None,
        "stage_started_at": None,
        "progress_done": 0,
        "progress_total": 0,
        "heartbeat_at": None,
        "enqueued_at": enqueued_at,
        "updated_at": now,
    }


def wait_for_storage(
    session: Session,
    job_id: str,
    message: str,
    free_bytes: int | None,
    *,
    worker_id: str | None = None,
    code: str = STORAGE_FULL,
) -> bool:
    """running -> queued because the storage is full: the attempt is not counted, the job
    shows error storage_full while it waits, and enqueued_at is cleared so that the sweep
    sends it again once the artifacts volume has more than `free_bytes` free. With
    code=storage_unavailable: the artifact store could not be reached, and the sweep sends the
    job again once it can. False (nothing changed) when cancel was requested or the job is
    not running (for this worker)."""
    if code not in STORAGE_WAITS:
        raise ValueError(f"storage wait code {code!r} is not one of {sorted(STORAGE_WAITS)}")
    now = utcnow()
    ok = _cas(
        session,
        job_id,
        [Job.status == RUNNING, Job.cancel_requested.is_(False), *_owned(worker_id)],
        {
            **_back_to_queue(now, enqueued_at=None),
            "attempts": Job.attempts - 1,
            "error_code": code,
            "error_message": message[:MAX_MESSAGE_CHARS],
            "wait_free_bytes": free_bytes,
            "updated_at": now,
        },
    )
    if not ok:
        session.rollback()
        return False
    session.commit()
    return True


def release_lost(
    session: Session, job_id: str, worker_id: str, max_attempts: int, reason: str
) -> str | None:
    """The process running the job (owned by worker_id) is known to be gone: back to queued
    at once, or failed with code "worker_lost" once max_attempts claims were used, or
    cancelled if cancel had been requested. Returns the new status, None when the job was not
    running for that worker (finished, or someone else's)."""
    now = utcnow()
    row = repository.running_attempts(session, job_id, worker_id)
    if row is None:
        session.rollback()
        return None
    attempts, cancel = row
    values: dict[str, Any]
    if cancel:
        values = {"status": CANCELLED, "finished_at": now, "updated_at": now}
    elif attempts >= max_attempts:
        values = {
            "status": FAILED,
            "error_code": WORKER_LOST,
            "error_message": f"{reason} on attempt {attempts} of {max_attempts}; giving up"[
                :MAX_MESSAGE_CHARS
            ],
            "finished_at": now,
            "updated_at": now,
        }
    else:
        # The broker gets the message back (the worker rejects it with requeue).
        values = _back_to_queue(now, enqueued_at=now)
    if not _cas(session, job_id, [Job.status == RUNNING, Job.worker_id == worker_id], values):
        session.rollback()
        return None
    session.commit()
    return str(values["status"])


def mark_cancelled(session: Session, job_id: str, *, worker_id: str | None = None) -> Job:
    """running | queued -> cancelled (the runner stopped). Idempotent on a cancelled job."""
    now = utcnow()
    job = _get(session, job_id)
    if job.status == CANCELLED:
        session.rollback()
        return job
    values = {
        "status": CANCELLED,
        "cancel_requested": True,
        "stage_durations": closed_stage_durations(job, now),
        "finished_at": now,
        "updated_at": now,
    }
    conditions: list[ColumnElement[bool]] = [Job.status.in_((QUEUED, RUNNING))]
    if worker_id is not None:
        conditions.append((Job.status == QUEUED) | (Job.worker_id == worker_id))
    if not _cas(session, job_id, conditions, values):
        raise _refused(session, job_id, "mark it cancelled")
    session.commit()
    return _get(session, job_id)


# ---------------------------------------------------------------- API side


def request_cancel(session: Session, job_id: str) -> Job:
    """A queued job becomes cancelled at once; a running one gets cancel_requested and the
    runner stops at the next layer boundary. Finished jobs: IllegalTransitionError (409)."""
    now = utcnow()
    if _cas(
        session,
        job_id,
        [Job.status == QUEUED],
        {"status": CANCELLED, "cancel_requested": True, "finished_at": now, "updated_at": now},
    ):
        session.commit()
        return _get(session, job_id)
    if _cas(
        session, job_id, [Job.status == RUNNING], {"cancel_requested": True, "updated_at": now}
    ):
        session.commit()
        return _get(session, job_id)
    raise _refused(session, job_id, "cancel it")


def mark_enqueued(session: Session, job_id: str, now: datetime | None = None) -> bool:
    """Record that the job id reached the broker (the sweep re-sends jobs without this)."""
    ok = _cas(session, job_id, [Job.status == QUEUED], {"enqueued_at": now or utcnow()})
    session.commit()
    return ok


# ---------------------------------------------------------------- sweep side


def list_unenqueued(session: Session, older_than: datetime, limit: int = 100) -> list[str]:
    """Ids of queued jobs created before `older_than` that never reached the broker (jobs
    waiting for storage excepted: list_storage_waiting)."""
    ids = repository.unenqueued_ids(session, older_than, STORAGE_WAITS, limit)
    session.rollback()
    return ids


def list_unclaimed(session: Session, enqueued_before: datetime, limit: int = 100) -> list[str]:
    """Ids of queued jobs sent to the broker before `enqueued_before` and still not claimed
    (their message may be lost: a broker restarted without persistence, a failover)."""
    ids = repository.unclaimed_ids(session, enqueued_before, limit)
    session.rollback()
    return ids


def count_enqueued(session: Session) -> int:
    """Queued jobs whose message was sent (each should have one waiting in the broker)."""
    n = repository.count_enqueued(session)
    session.rollback()
    return n


@dataclass(frozen=True)
class StorageWait:
    job_id: str
    free_bytes: int | None
    since: datetime


def list_storage_waiting(
    session: Session, limit: int = 100, code: str = STORAGE_FULL
) -> list[StorageWait]:
    """Queued jobs put back because the storage was full (or, with code=storage_unavailable,
    the artifact store unreachable), not yet sent again."""
    rows = [StorageWait(i, b, u) for i, b, u in repository.storage_waiting(session, code, limit)]
    session.rollback()
    return rows


def requeue_stale(
    session: Session, now: datetime, heartbeat_timeout: float | timedelta, max_attempts: int
) -> StaleSweep:
    """Running jobs whose heartbeat is older than the timeout: back to queued (enqueued_at
    cleared so list_unenqueued() re-sends them), or failed with code "worker_lost" once
    `max_attempts` claims were used, or cancelled if cancel had been requested."""
    timeout = (
        heartbeat_timeout
        if isinstance(heartbeat_timeout, timedelta)
        else timedelta(seconds=heartbeat_timeout)
    )
    cutoff = now - timeout
    # A job fanned out over many workers (job_parts rows of its attempt) is judged part by
    # part instead (app.jobs.parts.sweep_parts).
    stale_cond = [Job.status == RUNNING, Job.heartbeat_at < cutoff, ~repository.fanned_out()]
    rows = repository.stale_running(session, stale_cond)
    session.rollback()
    out = StaleSweep()
    for job_id, attempts, cancel in rows:
        if cancel:
            values: dict[str, Any] = {"status": CANCELLED, "finished_at": now, "updated_at": now}
            bucket = out.cancelled
        elif attempts >= max_attempts:
            values = {
                "status": FAILED,
                "error_code": WORKER_LOST,
                "error_message": (
                    f"the worker stopped sending heartbeats (none for {timeout.total_seconds():g}s) "
                    f"on attempt {attempts} of {max_attempts}; giving up"
                ),
                "finished_at": now,
                "updated_at": now,
            }
            bucket = out.failed
        else:
            values = _back_to_queue(now, enqueued_at=None)
            bucket = out.requeued
        # Re-check staleness in the UPDATE itself: a heartbeat that arrived meanwhile wins.
        if _cas(session, job_id, stale_cond, values):
            session.commit()
            bucket.append(job_id)
        else:
            session.rollback()
    return out
