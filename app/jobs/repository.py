"""Every query of the jobs domain. No business rules here (those live in service.py, and the
status transition rules in state.py, which runs its reads and writes through this module)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, and_, delete, func, or_, select, update
from sqlalchemy.orm import Session, selectinload
from sqlalchemy.sql.elements import ColumnElement

from app.db.models import QUEUED, RUNNING, Artifact, ArtifactFile, Job, JobLayer


def get_owned(session: Session, api_key_id: str, job_id: str) -> Job | None:
    """The job if it exists AND belongs to the key (another key's job is 'not found')."""
    return session.scalar(
        select(Job)
        .where(Job.id == job_id, Job.api_key_id == api_key_id)
        .options(selectinload(Job.artifacts))
        .execution_options(populate_existing=True)
    )


def by_idempotency_key(session: Session, api_key_id: str, key: str) -> Job | None:
    return session.scalar(
        select(Job)
        .where(Job.api_key_id == api_key_id, Job.idempotency_key == key)
        .options(selectinload(Job.artifacts))
    )


def page(
    session: Session,
    api_key_id: str,
    *,
    status: str | None,
    limit: int,
    after: tuple[datetime, str] | None,
) -> list[Job]:
    """Up to limit+1 jobs, newest first (created_at, id), strictly after the cursor."""
    stmt = select(Job).where(Job.api_key_id == api_key_id)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if after is not None:
        created, job_id = after
        stmt = stmt.where(
            or_(Job.created_at < created, and_(Job.created_at == created, Job.id < job_id))
        )
    stmt = (
        stmt.order_by(Job.created_at.desc(), Job.id.desc())
        .limit(limit + 1)
        .options(selectinload(Job.artifacts))
    )
    return list(session.scalars(stmt).all())


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
