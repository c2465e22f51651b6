"""Disk one API key holds, and the scratch of job attempts (HIGGS_DISK_QUOTA_BYTES_PER_KEY).

A key's usage is the bytes of its jobs' published artifacts plus the scratch of its running
attempts (jobs.scratch_bytes, which the worker measures while the attempt runs). A submit at
or above the quota is refused (422 disk_quota_exceeded); a running attempt that takes the key
past it fails with the same code (worker.scratch). Scratch of attempts that stopped is removed
by the worker's sweep, and what it freed is added to jobs.scratch_reclaimed_bytes (a failed
job's error shows it).
"""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.db.models import PART_RUNNING, RUNNING, Artifact, Job, JobPart
from app.errors import AppError

__all__ = [
    "DiskQuotaExceededError",
    "add_reclaimed",
    "check_disk_quota",
    "key_disk_usage",
    "live_attempts",
    "record_scratch",
]


class DiskQuotaExceededError(AppError):
    status, code, title = 422, "disk_quota_exceeded", "Disk quota exceeded"


def key_disk_usage(session: Session, api_key_id: str, *, except_job: str | None = None) -> int:
    """Bytes the key holds: its published artifacts and its running attempts' scratch
    (`except_job`'s scratch left out: the caller measures that one itself)."""
    artifacts = session.scalar(
        select(func.coalesce(func.sum(Artifact.total_bytes), 0))
        .join(Job, Job.id == Artifact.job_id)
        .where(Job.api_key_id == api_key_id)
    )
    running = select(func.coalesce(func.sum(Job.scratch_bytes), 0)).where(
        Job.api_key_id == api_key_id, Job.status == RUNNING
    )
    if except_job is not None:
        running = running.where(Job.id != except_job)
    return int(artifacts or 0) + int(session.scalar(running) or 0)


def size_text(nbytes: int) -> str:
    return f"{nbytes} bytes" if nbytes < 2**20 else f"{nbytes / 2**20:.1f} MiB"


def quota_message(used: int, quota: int) -> str:
    return (
        f"this API key holds {size_text(used)} of artifacts and scratch, and its disk quota is "
        f"{size_text(quota)} (HIGGS_DISK_QUOTA_BYTES_PER_KEY = {quota})"
    )


def check_disk_quota(session: Session, api_key_id: str, quota: int) -> None:
    """DiskQuotaExceededError when the key already holds `quota` bytes or more (0: no quota)."""
    if quota <= 0:
        return
    used = key_disk_usage(session, api_key_id)
    if used >= quota:
        raise DiskQuotaExceededError(
            quota_message(used, quota) + "; no new job until some of it is freed",
            errors=[{"field": "disk_quota", "message": quota_message(used, quota)}],
        )


def record_scratch(session: Session, job_id: str, nbytes: int) -> str | None:
    """Store the running attempt's scratch size; returns the job's key id (None: no job)."""
    session.execute(update(Job).where(Job.id == job_id).values(scratch_bytes=nbytes))
    key = session.scalar(select(Job.api_key_id).where(Job.id == job_id))
    session.commit()
    return key


def add_reclaimed(session: Session, job_id: str, nbytes: int) -> None:
    """Add `nbytes` of removed scratch to the job's count (its running scratch is then 0)."""
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(
            scratch_reclaimed_bytes=func.coalesce(Job.scratch_reclaimed_bytes, 0) + nbytes,
            scratch_bytes=None,
        )
    )
    session.commit()


def live_attempts(
    session: Session, job_ids: list[str]
) -> tuple[dict[str, int], set[tuple[str, int, int]]]:
    """Which of these jobs' attempts may still be writing scratch: {job id: attempt} of the
    running ones, and (job id, part index, job attempt) of their running parts."""
    if not job_ids:
        return {}, set()
    jobs = {
        job_id: int(attempts)
        for job_id, attempts in session.execute(
            select(Job.id, Job.attempts).where(Job.id.in_(job_ids), Job.status == RUNNING)
        )
    }
    parts = {
        (job_id, int(idx), int(attempt))
        for job_id, idx, attempt in session.execute(
            select(JobPart.job_id, JobPart.idx, JobPart.job_attempt).where(
                JobPart.job_id.in_(list(jobs)), JobPart.state == PART_RUNNING
            )
        )
    }
    return jobs, parts
