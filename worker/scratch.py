"""Scratch of job attempts on this worker's disk: the sweep's removal of what stopped attempts
left, and the disk quota of a running attempt (HIGGS_DISK_QUOTA_BYTES_PER_KEY).

Everything an attempt writes before it publishes is under its staging folder (worker.staging;
the engine's own temporary and scratch folders are made beside its output, inside it):

    .staging/<job_id>.<attempt>.<hex>/          a job attempt, or a fanned-out job's assembly
    .staging/<job_id>-part<i>.<attempt>.<hex>/  one part of a fanned-out job
    .staging/.trash-<name>-<hex>/               a folder renamed for removal (remove_tree)

An attempt that dies (a killed pool process, a machine gone) cannot remove its own folder, and
the next attempt clears only its own job's leftovers on its own host. So the sweep removes
every folder whose attempt is no longer running: the job is not running, or runs a later
attempt, or the part is not running; and trash left for over a minute. What it frees is added
to the job's scratch_reclaimed_bytes (a failed job's error shows it).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from app.jobs.disk import (
    add_reclaimed,
    key_disk_usage,
    live_attempts,
    quota_message,
    record_scratch,
    size_text,
)
from worker.dbretry import SessionFactory, retry_db
from worker.staging import STAGING, remove_tree

log = logging.getLogger("worker.scratch")

# <job_id>[-part<i>].<attempt>.<hex>, as worker.staging names them.
_NAME = re.compile(r"^(?P<job>[^./]+?)(?:-part(?P<idx>\d+))?\.(?P<attempt>\d+)\.[0-9a-f]+$")
TRASH_PREFIX = ".trash-"
# A trash folder younger than this may still be being removed by the attempt that renamed it.
TRASH_GRACE_S = 60.0


class DiskQuotaError(Exception):
    """The attempt took its key past the disk quota: the job fails with this code."""

    code = "disk_quota_exceeded"


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it is gone); links are not followed."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue  # removed meanwhile
    return total


def reclaim(path: Path) -> int:
    """Remove the folder `path`; returns the bytes it held."""
    nbytes = tree_bytes(path)
    remove_tree(path)
    return nbytes


@dataclass(frozen=True)
class ScratchDir:
    path: Path
    job_id: str | None  # None: trash, whoever left it
    part: int | None = None
    attempt: int = 0


def scratch_dirs(artifacts_dir: Path, now: float | None = None) -> list[ScratchDir]:
    """The attempt folders and old trash folders under the staging root."""
    root = artifacts_dir / STAGING
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    found = []
    for p in root.iterdir():
        if p.name.startswith(TRASH_PREFIX):
            try:
                old = now - p.lstat().st_mtime > TRASH_GRACE_S
            except OSError:
                continue
            if old:
                found.append(ScratchDir(p, None))
            continue
        m = _NAME.match(p.name)
        if m is not None and p.is_dir():
            idx = int(m["idx"]) if m["idx"] is not None else None
            found.append(ScratchDir(p, m["job"], idx, int(m["attempt"])))
    return found


@dataclass
class Reclaimed:
    """What one pass removed: bytes per job ("" for trash of unknown jobs) and the folders."""

    bytes_by_job: dict[str, int] = field(default_factory=dict)
    folders: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.bytes_by_job.values())


def _running(d: ScratchDir, jobs: dict[str, int], parts: set[tuple[str, int, int]]) -> bool:
    """Whether the folder's attempt (or part) is the one running now."""
    if d.job_id is None or jobs.get(d.job_id) != d.attempt:
        return False
    return d.part is None or (d.job_id, d.part, d.attempt) in parts


def sweep_scratch(sessions: sessionmaker[Session], artifacts_dir: Path) -> Reclaimed:
    """Remove the scratch of attempts that are no longer running (module docstring) and add
    what it held to each job's scratch_reclaimed_bytes."""
    dirs = scratch_dirs(artifacts_dir)
    out = Reclaimed()
    if not dirs:
        return out
    # Listed first, read second: a folder exists only after its attempt's claim committed,
    # so an attempt that is running now shows as running here.
    with sessions() as s:
        jobs, parts = live_attempts(s, sorted({d.job_id for d in dirs if d.job_id}))
    for d in dirs:
        if _running(d, jobs, parts):
            continue
        nbytes = reclaim(d.path)
        key = d.job_id or ""
        out.bytes_by_job[key] = out.bytes_by_job.get(key, 0) + nbytes
        out.folders.append(d.path.name)
    for job_id, nbytes in out.bytes_by_job.items():
        if job_id:
            with sessions() as s:
                add_reclaimed(s, job_id, nbytes)
    if out.folders:
        log.info(
            "sweep: removed %d scratch folder(s) of stopped attempts, %.1f MiB",
            len(out.folders),
            out.total / 2**20,
        )
    return out


def reclaim_failed(staging: Path, guard: object | None) -> int:
    """Remove a failed attempt's staging folder; returns what its scratch held: what is there
    now, or what the disk guard last measured when the engine already removed its own
    temporary output while failing."""
    nbytes = reclaim(staging)
    if isinstance(guard, DiskGuard):
        nbytes = max(nbytes, guard.last)
    return nbytes


def note_reclaimed(sessions: SessionFactory, job_id: str, nbytes: int, budget_s: float) -> None:
    """Add what the runner removed after a failed attempt to the job's count (best effort)."""
    if nbytes <= 0:
        return

    def once() -> None:
        with sessions() as s:
            add_reclaimed(s, job_id, nbytes)

    try:
        retry_db(once, f"scratch of job {job_id}", budget_s)
    except Exception as e:  # a count, not the job's outcome
        log.warning("job %s: could not record the reclaimed scratch: %s", job_id, e)


@dataclass
class DiskGuard:
    """Called from the attempt's progress callback: measures the staging folder (on every new
    stage, at the end of each stage, and otherwise at most every `interval_s`), records it on
    the job row, and raises DiskQuotaError once the key's artifacts, its other running
    attempts' scratch and this scratch together pass `quota` bytes."""

    sessions: SessionFactory
    job_id: str
    staging: Path
    quota: int
    interval_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    _next: float = -1e18
    # Bytes of the staging folder at the last check.
    last: int = 0
    _stage: str = ""

    def __call__(self, stage: str = "", done: int = 0, total: int = 0) -> None:
        now = self.clock()
        boundary = stage != self._stage or done >= total
        self._stage = stage
        if now < self._next and not boundary:
            return
        self._next = now + self.interval_s
        scratch = self.last = tree_bytes(self.staging)
        try:
            with self.sessions() as s:
                key = record_scratch(s, self.job_id, scratch)
                others = key_disk_usage(s, key, except_job=self.job_id) if key else 0
        except SQLAlchemyError as e:  # the database is away: the next call checks again
            log.warning("job %s: disk quota not checked: %s", self.job_id, e)
            return
        used = others + scratch
        if used > self.quota:
            raise DiskQuotaError(
                f"the job stopped: {quota_message(used, self.quota)} "
                f"({size_text(scratch)} of it this job's scratch)"
            )
