"""The periodic sweep: no accepted job is lost.

1. Running jobs whose heartbeat stopped (worker killed, machine gone) go back to the queue, or
   fail with code "worker_lost" once max_attempts claims were used (app.jobs.state.requeue_stale).
2. Queued jobs that never reached the broker (the broker was down at submit time, or step 1
   just re-queued them) are sent again, and marked as enqueued.
3. Queued jobs sent more than settings.queued_resend_s ago and still not claimed are sent
   again when the broker holds fewer messages than there are such jobs (messages were lost:
   Redis restarted without persistence, a failover, a flush). A duplicate is harmless: the
   claim is a compare-and-set, so the second delivery finds nothing to claim.
4. Jobs that went back to the queue because the storage was full (error storage_full) are
   sent again once the artifacts volume has more free space than after their attempt, or
   after settings.storage_retry_s. Jobs put back because the artifact store was unreachable
   (error storage_unavailable) are sent again once it answers.
5. Calibration uploads older than settings.calibration_retention_days that no queued or
   running job uses are deleted (app.calibrations.service.delete_expired).
6. Scratch that attempts no longer running left under the staging folder is removed, and
   what it held is added to each job's scratch_reclaimed_bytes (worker.scratch).

Every step is a compare-and-set in app.jobs.state, so several workers may sweep at once.

A database outage stops heartbeats as well as the sweep: after a pass that failed, step 1 is
skipped until heartbeat_timeout_s has passed with the database reachable, so that workers that
rode out the outage (they retry their writes) get to beat again before anyone judges them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.store import store_from_settings
from app.calibrations.service import delete_expired
from app.db.base import utcnow
from app.jobs import state
from app.settings import Settings
from worker.messages import volume_free
from worker.periodic import PeriodicThread
from worker.scratch import sweep_scratch

log = logging.getLogger("worker.sweep")

Enqueue = Callable[[str], bool]
# Messages waiting in the broker for the job queues; None when it cannot be read.
Depth = Callable[[], "int | None"]


@dataclass
class SweepResult:
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)
    send_failed: list[str] = field(default_factory=list)
    # Sent again: unclaimed past queued_resend_s (step 3), waiting for storage (step 4).
    resent: list[str] = field(default_factory=list)
    storage: list[str] = field(default_factory=list)
    # Calibration uploads deleted past their retention (step 5).
    calibrations: list[str] = field(default_factory=list)
    # Scratch folders of stopped attempts removed (step 6).
    scratch: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[str]]:
        return {
            "requeued": self.requeued,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "sent": self.sent,
            "send_failed": self.send_failed,
            "resent": self.resent,
            "storage": self.storage,
            "calibrations": self.calibrations,
            "scratch": self.scratch,
        }


def sweep(
    sessions: sessionmaker[Session],
    settings: Settings,
    enqueue: Enqueue,
    depth: Depth | None = None,
    *,
    requeue_stale: bool = True,
) -> SweepResult:
    """One pass; `enqueue(job_id)` sends the task and returns False when the broker is down;
    `depth()` counts the messages waiting in the broker (None: unknown, so step 3 re-sends)."""
    now = utcnow()
    out = SweepResult()
    if requeue_stale:
        with sessions() as s:
            stale = state.requeue_stale(s, now, settings.heartbeat_timeout_s, settings.max_attempts)
        out.requeued, out.failed, out.cancelled = stale.requeued, stale.failed, stale.cancelled
    with sessions() as s:
        # Jobs just re-queued above are sent now; others only after the grace period, so a
        # submit whose enqueue is in flight is not sent twice (twice would be harmless anyway).
        pending = state.list_unenqueued(s, now - timedelta(seconds=settings.enqueue_grace_s))
    with sessions() as s:
        unclaimed = state.list_unclaimed(s, now - timedelta(seconds=settings.queued_resend_s))
    if unclaimed:
        with sessions() as s:
            expected = state.count_enqueued(s)
        have = depth() if depth is not None else None
        if have is not None and have >= expected:
            unclaimed = []  # every sent job still has its message: they are only waiting
        else:
            log.warning(
                "sweep: %d queued job(s) unclaimed for over %gs and the broker holds %s message(s) "
                "for %d sent job(s): sending them again",
                len(unclaimed),
                settings.queued_resend_s,
                "unknown" if have is None else have,
                expected,
            )
    out.resent = list(unclaimed)
    out.storage = _storage_ready(sessions, settings) + _store_ready(sessions, settings)
    for job_id in dict.fromkeys([*out.requeued, *pending, *out.resent, *out.storage]):
        if enqueue(job_id):
            with sessions() as s:
                state.mark_enqueued(s, job_id)
            out.sent.append(job_id)
        else:
            out.send_failed.append(job_id)
    if settings.calibration_retention_days > 0:
        with sessions() as s:
            out.calibrations = delete_expired(
                s, now - timedelta(days=settings.calibration_retention_days)
            )
    # After step 1: an attempt it just gave up on is no longer running, so its scratch goes.
    out.scratch = sweep_scratch(sessions, settings.artifacts_path).folders
    if (
        out.requeued
        or out.failed
        or out.cancelled
        or out.sent
        or out.send_failed
        or out.calibrations
        or out.scratch
    ):
        log.info("sweep: %s", out.as_dict())
    return out


def _storage_ready(sessions: sessionmaker[Session], settings: Settings) -> list[str]:
    """Jobs waiting for storage that may run now: the artifacts volume has more free space
    than when they were put back (by a margin: 1% of the volume, at most 64 MiB), or they
    waited storage_retry_s (a quota, or another volume, that the free space does not show)."""
    with sessions() as s:
        waiting = state.list_storage_waiting(s)
    if not waiting:
        return []
    space = volume_free(settings.artifacts_path)
    ready = []
    for w in waiting:
        waited = (utcnow() - w.since).total_seconds()
        if waited >= settings.storage_retry_s:
            ready.append(w.job_id)
        elif space is not None and w.free_bytes is not None:
            free, total = space
            if free > w.free_bytes + min(64 * 2**20, total // 100):
                ready.append(w.job_id)
        elif space is None or w.free_bytes is None:
            ready.append(w.job_id)  # nothing to compare: try (the runner re-checks by writing)
    if ready:
        free_mib = "unknown" if space is None else f"{space[0] / 2**20:.1f} MiB"
        log.info(
            "sweep: storage has room again (%s free): sending %d waiting job(s)",
            free_mib,
            len(ready),
        )
    return ready


def _store_ready(sessions: sessionmaker[Session], settings: Settings) -> list[str]:
    """Jobs put back because the artifact store was unreachable (storage_unavailable), once it
    answers again (or after storage_retry_s: the runner checks it again itself)."""
    with sessions() as s:
        waiting = state.list_storage_waiting(s, code=state.STORAGE_UNAVAILABLE)
    if not waiting:
        return []
    try:
        store_from_settings(settings).check()
        reachable = True
    except Exception as e:
        log.info("sweep: artifact store still unavailable (%s): %d job(s) wait", e, len(waiting))
        reachable = False
    ready = [
        w.job_id
        for w in waiting
        if reachable or (utcnow() - w.since).total_seconds() >= settings.storage_retry_s
    ]
    if ready and reachable:
        log.info("sweep: the artifact store answers again: sending %d waiting job(s)", len(ready))
    return ready


def sweep_fanout(
    sessions: sessionmaker[Session],
    settings: Settings,
    send_part: Callable[[str, int, int], bool],
    send_assembly: Callable[[str, int], bool],
    *,
    requeue_stale: bool = True,
) -> dict[str, list[str]]:
    """Jobs fanned out over many workers (app.jobs.parts.sweep_parts): parts whose worker
    stopped beating go back to the queue and are sent again, parts never sent (or sent over
    queued_resend_s ago and still unclaimed: a lost message) are sent, and
    the barrier sends the assembly of jobs whose parts are all done but which no assembly
    claimed within enqueue_grace_s (the chord's message went down with its host)."""
    from app.jobs import parts

    with sessions() as s:
        found = parts.sweep_parts(
            s,
            utcnow(),
            # With stale checks paused (after an outage), nothing is judged dead.
            settings.heartbeat_timeout_s if requeue_stale else 10.0**9,
            settings.max_attempts,
            settings.enqueue_grace_s,
            resend_after_s=settings.queued_resend_s,
        )
    sent, assembled = [], []
    for job_id, attempt, idx in dict.fromkeys([*found.requeued, *found.unsent]):
        if send_part(job_id, attempt, idx):
            with sessions() as s:
                parts.mark_parts_enqueued(s, job_id, attempt, [idx])
            sent.append(f"{job_id}/{idx}")
    for job_id, attempt in found.assemble:
        if send_assembly(job_id, attempt):
            assembled.append(job_id)
    out = {
        "parts_requeued": [f"{j}/{i}" for j, _, i in found.requeued],
        "parts_sent": sent,
        "parts_failed": found.failed,
        "assembly_sent": assembled,
        "assembly_reset": found.assembly_reset,
    }
    if any(out.values()):
        log.info("sweep (fan-out): %s", out)
    return out


class SweepThread(PeriodicThread):
    """Runs sweep() every `interval` seconds in a daemon thread (inside the worker's main
    process, which stays free while the pool runs jobs)."""

    def __init__(
        self,
        run_once: Callable[[bool], object],
        interval: float,
        outage_grace_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """run_once(requeue_stale) does one pass. After a pass that failed (the database or
        broker away), passes run with requeue_stale=False until outage_grace_s (the heartbeat
        timeout) has passed since the first pass that worked again."""
        super().__init__("higgs-sweep", interval)
        self.run_once = run_once
        self.outage_grace_s = outage_grace_s
        self.clock = clock
        self._failed = False
        self._back_at: float | None = None

    def tick(self) -> None:
        self.pass_once()

    def stale_checks_allowed(self) -> bool:
        if self._failed:
            return False
        return self._back_at is None or self.clock() - self._back_at >= self.outage_grace_s

    def pass_once(self) -> None:
        allowed = self.stale_checks_allowed()
        try:
            self.run_once(allowed)
        except Exception as e:  # the database or broker may be briefly away; try again later
            if not self._failed:
                log.warning("sweep failed (stale-job checks paused until it works again): %s", e)
            self._failed = True
            return
        if self._failed:
            self._failed = False
            self._back_at = self.clock()
            log.info("sweep works again; stale-job checks resume in %gs", self.outage_grace_s)
