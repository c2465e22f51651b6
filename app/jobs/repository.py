"""Every query of the jobs domain. No business rules here (those live in service.py, and the
status transition rules in state.py and parts.py, which run their reads and writes through this
module)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    CursorResult,
    ScalarSelect,
    Select,
    and_,
    bindparam,
    delete,
    exists,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session, selectinload
from sqlalchemy.sql.elements import ColumnElement

from app.db.models import QUEUED, RUNNING, Artifact, ArtifactFile, Job, JobLayer, JobPart


def get_owned(session: Session, api_key_id: str, job_id: str) -> Job | None:
    """The job if it exists AND belongs to the key (another key's job is 'not found')."""
    return session.scalar(
        select(Job)
        .where(Job.id == job_id, Job.api_key_id == api_key_id)
        .options(selectinload(Job.artifacts))
        .execution_options(populate_existing=True)
    )


# ---------------------------------------------------------------- reads for the job view
# GET job and the job list are the API's hottest paths: they read through SQLAlchemy Core on
# one autocommit connection (app.db.session.Reads), only the columns the view shows, into
# plain records, which costs a fraction of an ORM session with its identity map and loaders.


@dataclass(frozen=True, slots=True)
class ArtifactRecord:
    format: str
    total_bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class JobRecord:
    """The columns of a job that its API view shows (attribute names as on Job)."""

    id: str
    status: str
    stage: str | None
    progress_done: int
    progress_total: int
    cancel_requested: bool
    attempts: int
    model_id: str
    model_revision: str | None
    request: dict[str, Any]
    config: dict[str, Any]
    error_code: str | None
    error_message: str | None
    summary: dict[str, Any] | None
    stage_durations: dict[str, Any] | None
    webhook_url: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime
    scratch_reclaimed_bytes: int | None = None
    # Only a succeeded job's artifacts are read (the view shows no others).
    artifacts: tuple[ArtifactRecord, ...] = ()


_JOBS = Job.__table__.c
_ARTS = Artifact.__table__.c
_VIEW_COLUMNS = [_JOBS[f.name] for f in fields(JobRecord) if f.name != "artifacts"]
_ART_COLUMNS = (_ARTS.format, _ARTS.total_bytes, _ARTS.sha256)
_NAMES = [c.name for c in _VIEW_COLUMNS]
_N = len(_VIEW_COLUMNS)


def _record(row: Sequence[Any], artifacts: tuple[ArtifactRecord, ...] = ()) -> JobRecord:
    return JobRecord(**dict(zip(_NAMES, row[:_N], strict=True)), artifacts=artifacts)


# Built once, with bound parameters: building a statement costs more than running it.
_READ_OWNED = (
    select(*_VIEW_COLUMNS, *_ART_COLUMNS)
    .select_from(Job.__table__.outerjoin(Artifact.__table__, _ARTS.job_id == _JOBS.id))
    .where(_JOBS.id == bindparam("job_id"), _JOBS.api_key_id == bindparam("key_id"))
    .order_by(_ARTS.format)
)
_READ_ARTIFACTS = (
    select(_ARTS.job_id, *_ART_COLUMNS)
    .where(_ARTS.job_id.in_(bindparam("job_ids", expanding=True)))
    .order_by(_ARTS.job_id, _ARTS.format)
)


def _page_statement(by_status: bool, after: bool) -> Select[Any]:
    stmt = select(*_VIEW_COLUMNS).where(_JOBS.api_key_id == bindparam("key_id"))
    if by_status:
        stmt = stmt.where(_JOBS.status == bindparam("status"))
    if after:
        created = bindparam("after_created", type_=_JOBS.created_at.type)
        job_id = bindparam("after_id", type_=_JOBS.id.type)
        stmt = stmt.where(
            or_(_JOBS.created_at < created, and_(_JOBS.created_at == created, _JOBS.id < job_id))
        )
    return stmt.order_by(_JOBS.created_at.desc(), _JOBS.id.desc()).limit(bindparam("limit"))


_READ_PAGE = {(s, a): _page_statement(s, a) for s in (False, True) for a in (False, True)}


def read_owned(conn: Connection, api_key_id: str, job_id: str) -> JobRecord | None:
    """The job's view columns and its artifacts in one statement (a LEFT JOIN, so the job and
    its artifacts are one snapshot), if the job belongs to the key."""
    rows = conn.execute(_READ_OWNED, {"job_id": job_id, "key_id": api_key_id}).all()
    if not rows:
        return None
    arts = tuple(ArtifactRecord(*r[_N:]) for r in rows if r[_N] is not None)
    return _record(rows[0], arts if rows[0].status == "succeeded" else ())


def read_page(
    conn: Connection,
    api_key_id: str,
    *,
    status: str | None,
    limit: int,
    after: tuple[datetime, str] | None,
) -> list[JobRecord]:
    """Up to limit+1 jobs of the key, newest first (created_at, id), strictly after the
    cursor; then the artifacts of the succeeded ones (a second statement only when the page
    has any: a job's artifacts are published with its status)."""
    params: dict[str, Any] = {"key_id": api_key_id, "limit": limit + 1}
    if status is not None:
        params["status"] = status
    if after is not None:
        params["after_created"], params["after_id"] = after
    stmt = _READ_PAGE[(status is not None, after is not None)]
    jobs = [_record(r) for r in conn.execute(stmt, params)]
    done = [j.id for j in jobs if j.status == "succeeded"]
    if not done:
        return jobs
    arts: dict[str, list[ArtifactRecord]] = {}
    for job_id, *art in conn.execute(_READ_ARTIFACTS, {"job_ids": done}):
        arts.setdefault(job_id, []).append(ArtifactRecord(*art))
    return [replace(j, artifacts=tuple(arts[j.id])) if j.id in arts else j for j in jobs]


def by_idempotency_key(session: Session, api_key_id: str, key: str) -> Job | None:
    return session.scalar(
        select(Job)
        .where(Job.api_key_id == api_key_id, Job.idempotency_key == key)
        .options(selectinload(Job.artifacts))
    )


def count_active(session: Session, api_key_id: str) -> int:
    """Jobs of the key that are queued or running."""
    return int(
        session.scalar(
            select(func.count())
            .select_from(Job)
            .where(Job.api_key_id == api_key_id, Job.status.in_((QUEUED, RUNNING)))
        )
        or 0
    )


def layers(session: Session, job_id: str) -> list[JobLayer]:
    return list(
        session.scalars(select(JobLayer).where(JobLayer.job_id == job_id).order_by(JobLayer.idx))
    )


def artifact(session: Session, job_id: str, fmt: str) -> Artifact | None:
    return session.scalar(
        select(Artifact)
        .where(Artifact.job_id == job_id, Artifact.format == fmt)
        .options(selectinload(Artifact.files))
    )


def counts_by_status(session: Session) -> dict[str, int]:
    rows = session.execute(select(Job.status, func.count()).group_by(Job.status)).all()
    return {str(s): int(c) for s, c in rows}


def recent_stage_durations(session: Session, limit: int) -> list[dict[str, Any]]:
    """stage_durations of the most recently finished jobs."""
    rows = session.scalars(
        select(Job.stage_durations)
        .where(Job.finished_at.is_not(None), Job.stage_durations.is_not(None))
        .order_by(Job.finished_at.desc())
        .limit(limit)
    ).all()
    return [dict(r) for r in rows if r]


# ------------------------------------------------- used by state.py (the transition rules)


def get(session: Session, job_id: str) -> Job | None:
    """The job, re-read from the database (any key's)."""
    return session.get(Job, job_id, populate_existing=True)


def compare_and_set(
    session: Session,
    job_id: str,
    conditions: Iterable[ColumnElement[bool]],
    values: Mapping[str, Any],
) -> bool:
    """UPDATE jobs SET values WHERE id = job_id AND conditions; True when the row matched."""
    stmt = (
        update(Job)
        .where(Job.id == job_id, *conditions)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return cast(CursorResult[Any], session.execute(stmt)).rowcount == 1


def cancel_requested(session: Session, job_id: str) -> bool:
    return bool(session.execute(select(Job.cancel_requested).where(Job.id == job_id)).scalar_one())


def replace_rows(
    session: Session, job_id: str, layers: Sequence[JobLayer], artifacts: Sequence[Artifact]
) -> None:
    """Delete the job's layer and artifact rows (a redelivered job that got this far before
    may have left some) and add the new ones: replace, never duplicate."""
    session.execute(delete(JobLayer).where(JobLayer.job_id == job_id))
    old = session.scalars(select(Artifact.id).where(Artifact.job_id == job_id)).all()
    if old:
        session.execute(delete(ArtifactFile).where(ArtifactFile.artifact_id.in_(old)))
        session.execute(delete(Artifact).where(Artifact.id.in_(old)))
    session.add_all(layers)
    session.add_all(artifacts)


def running_attempts(session: Session, job_id: str, worker_id: str) -> tuple[int, bool] | None:
    """(attempts, cancel_requested) of the job if it is running for worker_id, else None."""
    row = session.execute(
        select(Job.attempts, Job.cancel_requested).where(
            Job.id == job_id, Job.status == RUNNING, Job.worker_id == worker_id
        )
    ).first()
    return None if row is None else (int(row[0]), bool(row[1]))


def stale_running(
    session: Session, conditions: Iterable[ColumnElement[bool]]
) -> list[tuple[str, int, bool]]:
    """(id, attempts, cancel_requested) of the jobs matching `conditions` (stale running)."""
    rows = session.execute(
        select(Job.id, Job.attempts, Job.cancel_requested).where(*conditions)
    ).all()
    return [(str(i), int(a), bool(c)) for i, a, c in rows]


def unenqueued_ids(
    session: Session, older_than: datetime, exclude_codes: Sequence[str], limit: int
) -> list[str]:
    """Queued jobs created before `older_than` never sent to the broker, oldest first,
    except those whose error_code is one of exclude_codes."""
    stmt = (
        select(Job.id)
        .where(
            Job.status == QUEUED,
            Job.enqueued_at.is_(None),
            Job.created_at < older_than,
            Job.error_code.is_(None) | Job.error_code.not_in(exclude_codes),
        )
        .order_by(Job.created_at)
        .limit(limit)
    )
    return list(session.scalars(stmt).all())


def unclaimed_ids(session: Session, enqueued_before: datetime, limit: int) -> list[str]:
    """Queued jobs sent to the broker before `enqueued_before`, oldest send first."""
    stmt = (
        select(Job.id)
        .where(Job.status == QUEUED, Job.enqueued_at < enqueued_before)
        .order_by(Job.enqueued_at)
        .limit(limit)
    )
    return list(session.scalars(stmt).all())


def count_enqueued(session: Session) -> int:
    """Queued jobs whose message was sent."""
    n = session.scalar(
        select(func.count())
        .select_from(Job)
        .where(Job.status == QUEUED, Job.enqueued_at.is_not(None))
    )
    return int(n or 0)


def storage_waiting(
    session: Session, code: str, limit: int
) -> list[tuple[str, int | None, datetime]]:
    """(id, wait_free_bytes, updated_at) of queued, unsent jobs with error_code `code`."""
    stmt = (
        select(Job.id, Job.wait_free_bytes, Job.updated_at)
        .where(Job.status == QUEUED, Job.enqueued_at.is_(None), Job.error_code == code)
        .order_by(Job.updated_at)
        .limit(limit)
    )
    return [(str(i), b, u) for i, b, u in session.execute(stmt).all()]


def fanned_out() -> ColumnElement[bool]:
    """Jobs whose current attempt is fanned out: it has job_parts rows (a condition on Job)."""
    return exists().where(JobPart.job_id == Job.id, JobPart.job_attempt == Job.attempts)


def holds(session: Session, condition: ColumnElement[bool]) -> bool:
    """Whether `condition` (an EXISTS) holds now."""
    return bool(session.scalar(select(condition)))


def job_ids(session: Session, conditions: Iterable[ColumnElement[bool]]) -> list[str]:
    """Ids of the jobs matching `conditions`."""
    return list(session.execute(select(Job.id).where(*conditions)).scalars().all())


def job_attempts(
    session: Session, conditions: Iterable[ColumnElement[bool]]
) -> list[tuple[str, int]]:
    """(id, attempts) of the jobs matching `conditions`."""
    return [(j, a) for j, a in session.execute(select(Job.id, Job.attempts).where(*conditions))]


# ------------------------------------------------- used by parts.py (a fanned-out job's rows)


def get_part(session: Session, job_id: str, idx: int, *, fresh: bool = True) -> JobPart | None:
    """The part row; re-read from the database unless fresh=False (then as this session
    last saw it)."""
    if fresh:
        return session.get(JobPart, (job_id, idx), populate_existing=True)
    return session.get(JobPart, (job_id, idx))


def update_parts(
    session: Session,
    job_id: str,
    attempt: int,
    conditions: Iterable[ColumnElement[bool]],
    values: Mapping[str, Any],
) -> int:
    """UPDATE job_parts SET values WHERE the row is of the job attempt AND conditions; the
    number of rows matched."""
    stmt = (
        update(JobPart)
        .where(JobPart.job_id == job_id, JobPart.job_attempt == attempt, *conditions)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return int(cast(CursorResult[Any], session.execute(stmt)).rowcount)


def compare_and_set_part(
    session: Session,
    job_id: str,
    attempt: int,
    idx: int,
    conditions: Iterable[ColumnElement[bool]],
    values: Mapping[str, Any],
) -> bool:
    """UPDATE job_parts SET values WHERE the part is (job_id, attempt, idx) AND conditions;
    True when the row matched."""
    return update_parts(session, job_id, attempt, [JobPart.idx == idx, *conditions], values) == 1


def replace_parts(session: Session, job_id: str, parts: Iterable[JobPart]) -> None:
    """Delete every part row of the job (any attempt) and add `parts`."""
    session.execute(delete(JobPart).where(JobPart.job_id == job_id))
    session.add_all(parts)


def count_parts(session: Session, job_id: str, attempt: int) -> int:
    n = session.scalar(
        select(func.count())
        .select_from(JobPart)
        .where(JobPart.job_id == job_id, JobPart.job_attempt == attempt)
    )
    return int(n or 0)


def parts_progress(job_id: str, attempt: int) -> ScalarSelect[Any]:
    """The sum of the attempt's parts' progress_done, as a value to write on the job."""
    return (
        select(func.coalesce(func.sum(JobPart.progress_done), 0))
        .where(JobPart.job_id == job_id, JobPart.job_attempt == attempt)
        .scalar_subquery()
    )


def parts(session: Session, job_id: str, attempt: int) -> list[JobPart]:
    """The attempt's part rows by index, re-read from the database."""
    return list(
        session.scalars(
            select(JobPart)
            .where(JobPart.job_id == job_id, JobPart.job_attempt == attempt)
            .order_by(JobPart.idx)
            .execution_options(populate_existing=True)
        ).all()
    )


def current_parts(
    session: Session, conditions: Iterable[ColumnElement[bool]]
) -> list[tuple[str, int, int, int, str | None]]:
    """(job_id, job_attempt, idx, attempts, worker_id) of the parts of their job's current
    attempt matching `conditions` (on the part and its job)."""
    rows = session.execute(
        select(
            JobPart.job_id, JobPart.job_attempt, JobPart.idx, JobPart.attempts, JobPart.worker_id
        )
        .join(Job, and_(Job.id == JobPart.job_id, Job.attempts == JobPart.job_attempt))
        .where(*conditions)
    ).all()
    return [(j, a, i, n, w) for j, a, i, n, w in rows]
