"""The transitions of a job fanned out over many workers (the job_parts rows), and the job
transitions they cause. Like app.jobs.state: one transaction per function, compare-and-set
UPDATEs, so duplicate messages and racing workers are harmless.

    job running (claimed by the coordinator) --fan_out--> parts queued, job stage "quantizing"
    part queued -> running (claim_part) -> done (finish_part)
                                        -> queued (its worker died: release_lost_part,
                                                   requeue_stale_parts)
                                        -> failed (fail_part: the job fails, siblings cancelled)
    every part done --claim_assembly--> job stage "packaging" (one assembler) -> succeeded
    cancel requested --cancel_fanout--> job cancelled, parts cancelled

Every query runs through app.jobs.repository (job rows with its compare_and_set); this module
holds the rules.

Parts belong to one attempt of the job (job_attempt = jobs.attempts when fanned out): a message
of an older attempt finds nothing to claim. While a job is fanned out its heartbeat is kept by
its parts (and by the assembler); the job-level stale sweep leaves it to the part sweep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import exists, or_
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from app.db.base import utcnow
from app.db.models import (
    CANCELLED,
    FAILED,
    PART_CANCELLED,
    PART_DONE,
    PART_FAILED,
    PART_QUEUED,
    PART_RUNNING,
    RUNNING,
    Job,
    JobPart,
)
from app.jobs import repository
from app.jobs.state import MAX_MESSAGE_CHARS, WORKER_LOST, closed_stage_durations

FANOUT_STAGE = "quantizing"
ASSEMBLY_STAGES = ("packaging", "uploading")


@dataclass(frozen=True)
class PartSpec:
    idx: int
    shards: tuple[str, ...]
    total: int  # layers the part quantizes (for the job's progress total)


@dataclass(frozen=True)
class PartClaim:
    job_id: str
    job_attempt: int
    idx: int
    shards: tuple[str, ...]
    attempts: int
    model_id: str
    model_revision: str | None
    request: dict[str, Any]
    engine_config: dict[str, Any]
    n_parts: int  # parts of this job attempt
    plan: dict[str, Any] | None  # the job plan every part runs (None: an older row)


@dataclass(frozen=True)
class PartView:
    idx: int
    shards: list[str]
    state: str
    worker_id: str | None
    attempts: int
    seconds: float | None
    output_uri: str | None
    finished_at: datetime | None
    engine_config: dict[str, Any]
    output: dict[str, Any] | None
    plan: dict[str, Any] | None = None


_cas = repository.compare_and_set
_cas_part = repository.compare_and_set_part


def _live(attempt: int) -> list[ColumnElement[bool]]:
    """The job runs this attempt and no cancel was asked (conditions on Job, beside its id)."""
    return [Job.status == RUNNING, Job.attempts == attempt, Job.cancel_requested.is_(False)]


def _job_is_live(job_id: str, attempt: int) -> ColumnElement[bool]:
    return exists().where(Job.id == job_id, *_live(attempt))


def _running(worker_id: str | None) -> list[ColumnElement[bool]]:
    """The part while it runs, on `worker_id` (None: on any worker)."""
    conds = [JobPart.state == PART_RUNNING]
    if worker_id is not None:
        conds.append(JobPart.worker_id == worker_id)
    return conds


# ---------------------------------------------------------------- the coordinator


def fan_out(
    session: Session,
    job_id: str,
    worker_id: str,
    attempt: int,
    parts: Sequence[PartSpec],
    plan: dict[str, Any],
) -> bool:
    """The coordinator's claimed job becomes fanned out: one queued row per part (rows of
    earlier attempts replaced) carrying the job plan (its config also as engine_config),
    stage quantizing with the parts' layers as the total. False when the job is no longer the
    coordinator's to run (cancelled, re-queued)."""
    now = utcnow()
    job = repository.get(session, job_id)
    if job is None:
        session.rollback()
        return False
    matched = _cas(
        session,
        job_id,
        [*_live(attempt), Job.worker_id == worker_id],
        {
            "stage": FANOUT_STAGE,
            "stage_durations": closed_stage_durations(job, now),
            "stage_started_at": now,
            "progress_done": 0,
            "progress_total": sum(p.total for p in parts),
            "heartbeat_at": now,
            "updated_at": now,
        },
    )
    if not matched:
        session.rollback()
        return False
    repository.replace_parts(
        session,
        job_id,
        (
            JobPart(
                job_id=job_id,
                idx=p.idx,
                job_attempt=attempt,
                shards=list(p.shards),
                engine_config=dict(plan["config"]),
                plan=dict(plan),
                state=PART_QUEUED,
                attempts=0,
                progress_done=0,
                progress_total=p.total,
            )
            for p in parts
        ),
    )
    session.commit()
    return True


def mark_parts_enqueued(session: Session, job_id: str, attempt: int, idxs: Sequence[int]) -> None:
    repository.update_parts(
        session,
        job_id,
        attempt,
        [JobPart.idx.in_(list(idxs)), JobPart.state == PART_QUEUED],
        {"enqueued_at": utcnow()},
    )
    session.commit()


# ---------------------------------------------------------------- a part's worker


def claim_part(
    session: Session, job_id: str, attempt: int, idx: int, worker_id: str
) -> PartClaim | None:
    """queued -> running (attempts += 1) while the job runs this attempt and no cancel was
    asked. None when there is nothing to claim (duplicate message, older attempt, done)."""
    now = utcnow()
    matched = _cas_part(
        session,
        job_id,
        attempt,
        idx,
        [JobPart.state == PART_QUEUED, _job_is_live(job_id, attempt)],
        {
            "state": PART_RUNNING,
            "attempts": JobPart.attempts + 1,
            "worker_id": worker_id,
            "started_at": now,
            "heartbeat_at": now,
            "progress_done": 0,
            "error_code": None,
            "error_message": None,
        },
    )
    if not matched:
        session.rollback()
        return None
    session.commit()
    part = repository.get_part(session, job_id, idx)
    job = repository.get(session, job_id)
    n_parts = repository.count_parts(session, job_id, attempt)
    session.rollback()
    if part is None or job is None:
        return None
    return PartClaim(
        job_id,
        attempt,
        idx,
        tuple(part.shards),
        part.attempts,
        job.model_id,
        job.model_revision,
        dict(job.request),
        dict(part.engine_config),
        n_parts,
        None if part.plan is None else dict(part.plan),
    )


def _touch_job(session: Session, job_id: str, attempt: int, progress: bool) -> None:
    now = utcnow()
    values: dict[str, Any] = {"heartbeat_at": now, "updated_at": now}
    if progress:
        values["progress_done"] = repository.parts_progress(job_id, attempt)
    _cas(session, job_id, [Job.status == RUNNING, Job.attempts == attempt], values)


def record_part_progress(
    session: Session,
    job_id: str,
    attempt: int,
    idx: int,
    worker_id: str,
    done: int | None = None,
    total: int | None = None,
) -> bool:
    """The part's progress (None: a heartbeat only), and the job's heartbeat and progress (the
    sum over its parts). False when the part should stop: not running for this worker, or
    the job is no longer running this attempt, or cancel was asked."""
    now = utcnow()
    values: dict[str, Any] = {"heartbeat_at": now}
    if done is not None:
        values["progress_done"] = int(done)
    if total is not None:
        values["progress_total"] = int(total)
    matched = _cas_part(session, job_id, attempt, idx, _running(worker_id), values)
    if not matched:
        session.rollback()
        return False
    _touch_job(session, job_id, attempt, progress=done is not None)
    live = repository.holds(session, _job_is_live(job_id, attempt))
    session.commit()
    return live


def finish_part(
    session: Session,
    job_id: str,
    attempt: int,
    idx: int,
    worker_id: str,
    seconds: float,
    output_uri: str,
    output: dict[str, Any] | None = None,
) -> bool:
    """running -> done, recording where its output is and its metadata (`output`). False (nothing recorded) when the part
    is not this worker's or the job stopped meanwhile: the caller removes its output."""
    now = utcnow()
    matched = _cas_part(
        session,
        job_id,
        attempt,
        idx,
        [*_running(worker_id), _job_is_live(job_id, attempt)],
        {
            "state": PART_DONE,
            "finished_at": now,
            "heartbeat_at": now,
            "seconds": round(float(seconds), 6),
            "output_uri": output_uri,
            "output": output,
            "progress_done": JobPart.progress_total,
        },
    )
    if not matched:
        session.rollback()
        return False
    _touch_job(session, job_id, attempt, progress=True)
    session.commit()
    return True


def _stop_siblings(session: Session, job_id: str, attempt: int, now: datetime) -> None:
    repository.update_parts(
        session,
        job_id,
        attempt,
        [JobPart.state.in_((PART_QUEUED, PART_RUNNING))],
        {"state": PART_CANCELLED, "finished_at": now},
    )


def fail_part(
    session: Session,
    job_id: str,
    attempt: int,
    idx: int,
    worker_id: str | None,
    code: str,
    message: str,
) -> bool:
    """The part failed for a reason other than a lost worker: the part is failed, the job
    fails with the part's code and message, its other parts are cancelled. False when the
    job was no longer running this attempt (nothing changed)."""
    now = utcnow()
    matched = _cas_part(
        session,
        job_id,
        attempt,
        idx,
        _running(worker_id),
        {
            "state": PART_FAILED,
            "finished_at": now,
            "error_code": code[:64],
            "error_message": message[:MAX_MESSAGE_CHARS],
        },
    )
    if not matched:
        session.rollback()
        return False
    part = repository.get_part(session, job_id, idx, fresh=False)
    shards = ", ".join(part.shards) if part is not None else "?"
    matched = _cas(
        session,
        job_id,
        [Job.status == RUNNING, Job.attempts == attempt],
        {
            "status": FAILED,
            "error_code": code[:64],
            "error_message": f"part {idx} ({shards}): {message}"[:MAX_MESSAGE_CHARS],
            "stage": None,
            "stage_started_at": None,
            "finished_at": now,
            "updated_at": now,
        },
    )
    if not matched:
        session.rollback()
        return False
    _stop_siblings(session, job_id, attempt, now)
    session.commit()
    return True


def cancel_fanout(session: Session, job_id: str, attempt: int) -> bool:
    """A fanned-out job whose cancel was asked: cancelled, with every unfinished part. True
    when the job is cancelled (now or before); False when it is not this attempt's to cancel."""
    now = utcnow()
    job = repository.get(session, job_id)
    if job is None or job.attempts != attempt:
        session.rollback()
        return False
    if job.status == CANCELLED:
        session.rollback()
        return True
    matched = _cas(
        session,
        job_id,
        [Job.status == RUNNING, Job.attempts == attempt, Job.cancel_requested.is_(True)],
        {"status": CANCELLED, "finished_at": now, "updated_at": now, "stage": None},
    )
    if not matched:
        session.rollback()
        return False
    _stop_siblings(session, job_id, attempt, now)
    session.commit()
    return True


def release_lost_part(
    session: Session,
    job_id: str,
    attempt: int,
    idx: int,
    worker_id: str,
    max_attempts: int,
    reason: str,
    message_returns: bool = True,
) -> str | None:
    """The process running the part (owned by worker_id) is gone: the part goes back to
    queued (its message comes back to the broker; with message_returns=False it is marked
    unsent and the sweep sends it again), or, once max_attempts claims were used, the job
    fails with worker_lost. Returns the part's new state, None if it was not running for
    that worker."""
    part = repository.get_part(session, job_id, idx)
    if (
        part is None
        or part.job_attempt != attempt
        or part.state != PART_RUNNING
        or part.worker_id != worker_id
    ):
        session.rollback()
        return None
    if part.attempts >= max_attempts:
        session.rollback()
        msg = f"{reason} on attempt {part.attempts} of {max_attempts}; giving up"
        return (
            PART_FAILED
            if fail_part(session, job_id, attempt, idx, worker_id, WORKER_LOST, msg)
            else None
        )
    matched = _cas_part(
        session,
        job_id,
        attempt,
        idx,
        _running(worker_id),
        {
            "state": PART_QUEUED,
            "worker_id": None,
            "heartbeat_at": None,
            "enqueued_at": utcnow() if message_returns else None,
        },
    )
    if not matched:
        session.rollback()
        return None
    session.commit()
    return PART_QUEUED


# ---------------------------------------------------------------- the assembler


def claim_assembly(session: Session, job_id: str, attempt: int, worker_id: str) -> bool:
    """Every part of this attempt done, the job still running it at stage quantizing, no
    cancel: the job's stage becomes packaging, owned by worker_id (one assembler wins)."""
    now = utcnow()
    not_done = exists().where(
        JobPart.job_id == job_id, JobPart.job_attempt == attempt, JobPart.state != PART_DONE
    )
    any_part = exists().where(JobPart.job_id == job_id, JobPart.job_attempt == attempt)
    job = repository.get(session, job_id)
    if job is None:
        session.rollback()
        return False
    # The parts' stage ends here (its time goes to stage_durations, as a single run's does).
    durations = closed_stage_durations(job, now)
    matched = _cas(
        session,
        job_id,
        [*_live(attempt), Job.stage == FANOUT_STAGE, ~not_done, any_part],
        {
            "stage": "packaging",
            "stage_durations": durations,
            "stage_started_at": now,
            "progress_done": 0,
            "progress_total": 1,
            "worker_id": worker_id,
            "heartbeat_at": now,
            "updated_at": now,
        },
    )
    if not matched:
        session.rollback()
        return False
    session.commit()
    return True


def parts_of(session: Session, job_id: str, attempt: int) -> list[PartView]:
    rows = repository.parts(session, job_id, attempt)
    out = [
        PartView(
            r.idx,
            list(r.shards),
            r.state,
            r.worker_id,
            r.attempts,
            r.seconds,
            r.output_uri,
            r.finished_at,
            dict(r.engine_config),
            None if r.output is None else dict(r.output),
            None if r.plan is None else dict(r.plan),
        )
        for r in rows
    ]
    session.rollback()
    return out


# ---------------------------------------------------------------- the sweep


@dataclass
class PartSweep:
    requeued: list[tuple[str, int, int]]  # (job, attempt, part) back to queued, to send
    failed: list[str]  # jobs failed (worker_lost after max_attempts)
    unsent: list[tuple[str, int, int]]  # queued parts never sent
    assemble: list[tuple[str, int]]  # (job, attempt) whose parts are all done (or cancelled)
    assembly_reset: list[str]  # jobs whose assembler stopped beating


def sweep_parts(
    session: Session,
    now: datetime,
    heartbeat_timeout_s: float,
    max_attempts: int,
    barrier_grace_s: float,
    resend_after_s: float | None = None,
) -> PartSweep:
    """1. running parts whose heartbeat stopped: back to queued (or the job fails with
    worker_lost once max_attempts claims were used); 2. assemblies whose heartbeat stopped:
    the job goes back to stage quantizing; 3. queued parts never sent, and (resend_after_s)
    those sent that long ago and still unclaimed (their message may be lost: a duplicate is
    harmless, the claim is a compare-and-set); 4. the barrier: jobs
    whose parts are all done for barrier_grace_s and no assembly claimed (the chord's message
    lost with its host), and cancelled-while-waiting jobs, to send an assembly to."""
    cutoff = now - timedelta(seconds=heartbeat_timeout_s)
    out = PartSweep([], [], [], [], [])
    _requeue_stale_parts(session, cutoff, heartbeat_timeout_s, max_attempts, out)
    _reset_stuck_assemblies(session, now, cutoff, out)
    out.unsent = _unsent_parts(session, now, resend_after_s)
    out.assemble = _barrier(session, now - timedelta(seconds=barrier_grace_s))
    session.rollback()
    return out


def _requeue_stale_parts(
    session: Session,
    cutoff: datetime,
    heartbeat_timeout_s: float,
    max_attempts: int,
    out: PartSweep,
) -> None:
    """Running parts without a heartbeat since `cutoff`: queued again, or their job failed as
    worker_lost once `max_attempts` claims were used."""
    stale = repository.current_parts(
        session,
        [JobPart.state == PART_RUNNING, JobPart.heartbeat_at < cutoff, Job.status == RUNNING],
    )
    session.rollback()
    for job_id, attempt, idx, attempts, worker in stale:
        if attempts >= max_attempts:
            msg = (
                f"the worker running part {idx} stopped sending heartbeats (none for "
                f"{heartbeat_timeout_s:g}s) on attempt {attempts} of {max_attempts}; giving up"
            )
            if fail_part(session, job_id, attempt, idx, worker, WORKER_LOST, msg):
                out.failed.append(job_id)
            continue
        matched = _cas_part(
            session,
            job_id,
            attempt,
            idx,
            [JobPart.state == PART_RUNNING, JobPart.heartbeat_at < cutoff],
            {"state": PART_QUEUED, "worker_id": None, "heartbeat_at": None, "enqueued_at": None},
        )
        if matched:
            session.commit()
            out.requeued.append((job_id, attempt, idx))
        else:
            session.rollback()


def _reset_stuck_assemblies(
    session: Session, now: datetime, cutoff: datetime, out: PartSweep
) -> None:
    """Assemblies that stopped beating: their job's stage goes back, the barrier resends."""
    stuck = repository.job_ids(
        session,
        [
            Job.status == RUNNING,
            Job.stage.in_(ASSEMBLY_STAGES),
            Job.heartbeat_at < cutoff,
            repository.fanned_out(),
        ],
    )
    for job_id in stuck:
        matched = _cas(
            session,
            job_id,
            [Job.status == RUNNING, Job.stage.in_(ASSEMBLY_STAGES), Job.heartbeat_at < cutoff],
            {"stage": FANOUT_STAGE, "heartbeat_at": now, "updated_at": now},
        )
        if matched:
            session.commit()
            out.assembly_reset.append(str(job_id))
        else:
            session.rollback()


def _unsent_parts(
    session: Session, now: datetime, resend_after_s: float | None
) -> list[tuple[str, int, int]]:
    """Queued parts never sent, and (resend_after_s) those sent that long ago, unclaimed."""
    return [
        (str(j), int(a), int(i))
        for j, a, i, _, _ in repository.current_parts(
            session,
            [
                JobPart.state == PART_QUEUED,
                Job.status == RUNNING,
                JobPart.enqueued_at.is_(None)
                if resend_after_s is None
                else or_(
                    JobPart.enqueued_at.is_(None),
                    JobPart.enqueued_at < now - timedelta(seconds=resend_after_s),
                ),
            ],
        )
    ]


def _barrier(session: Session, grace: datetime) -> list[tuple[str, int]]:
    """Jobs whose parts have all been done since before `grace` with no assembly claimed, and
    cancelled jobs with no open part: each (job, attempt) once."""
    open_parts = exists().where(
        JobPart.job_id == Job.id,
        JobPart.job_attempt == Job.attempts,
        JobPart.state.in_((PART_QUEUED, PART_RUNNING)),
    )
    recent = exists().where(
        JobPart.job_id == Job.id, JobPart.job_attempt == Job.attempts, JobPart.finished_at >= grace
    )
    ready = repository.job_attempts(
        session,
        [
            Job.status == RUNNING,
            Job.stage == FANOUT_STAGE,
            repository.fanned_out(),
            ~open_parts,
            ~recent,
        ],
    )
    waiting_cancel = repository.job_attempts(
        session,
        [
            Job.status == RUNNING,
            Job.cancel_requested.is_(True),
            repository.fanned_out(),
            ~open_parts,
        ],
    )
    return list(dict.fromkeys((str(j), int(a)) for j, a in [*ready, *waiting_cancel]))
