"""The periodic sweep: no accepted job is lost.

1. Running jobs whose heartbeat stopped (worker killed, machine gone) go back to the queue, or
   fail with code "worker_lost" once max_attempts claims were used (app.jobs.state.requeue_stale).
2. Queued jobs that never reached the broker (the broker was down at submit time, or step 1
   just re-queued them) are sent again, and marked as enqueued.

Every step is a compare-and-set in app.jobs.state, so several workers may sweep at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from app.db.base import utcnow
from app.jobs import state
from app.settings import Settings

log = logging.getLogger("worker.sweep")

Enqueue = Callable[[str], bool]


@dataclass
class SweepResult:
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)
    send_failed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[str]]:
        return {
            "requeued": self.requeued,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "sent": self.sent,
            "send_failed": self.send_failed,
        }


def sweep(sessions: sessionmaker[Session], settings: Settings, enqueue: Enqueue) -> SweepResult:
    """One pass; `enqueue(job_id)` sends the task and returns False when the broker is down."""
    now = utcnow()
    out = SweepResult()
    with sessions() as s:
        stale = state.requeue_stale(s, now, settings.heartbeat_timeout_s, settings.max_attempts)
    out.requeued, out.failed, out.cancelled = stale.requeued, stale.failed, stale.cancelled
    with sessions() as s:
        # Jobs just re-queued above are sent now; others only after the grace period, so a
        # submit whose enqueue is in flight is not sent twice (twice would be harmless anyway).
        pending = state.list_unenqueued(s, now - timedelta(seconds=settings.enqueue_grace_s))
    for job_id in dict.fromkeys([*out.requeued, *pending]):
        if enqueue(job_id):
            with sessions() as s:
                state.mark_enqueued(s, job_id)
            out.sent.append(job_id)
        else:
            out.send_failed.append(job_id)
    if out.requeued or out.failed or out.cancelled or out.sent or out.send_failed:
        log.info("sweep: %s", out.as_dict())
    return out


class SweepThread:
    """Runs sweep() every `interval` seconds in a daemon thread (inside the worker's main
    process, which stays free while the pool runs jobs)."""

    def __init__(self, run_once: Callable[[], object], interval: float) -> None:
        self.run_once = run_once
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="higgs-sweep", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        # First pass right away: a restarted worker picks up what its predecessor left.
        while True:
            try:
                self.run_once()
            except Exception as e:  # the database or broker may be briefly away; try again later
                log.warning("sweep failed: %s", e)
            if self._stop.wait(self.interval):
                return
