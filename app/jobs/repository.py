"""Every query of the jobs domain. No business rules here (those live in service.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session, selectinload

from app.db.models import QUEUED, RUNNING, Artifact, Job, JobLayer


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
