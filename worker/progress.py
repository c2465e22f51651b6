"""The engine's progress callback for a job attempt or for one part of a fanned-out job, and
its heartbeats: ProgressWriter writes stage / done / total (and so the heartbeat) to the job
row, PartProgress to the part row (summed into the job's), and heartbeating() beats between
progress calls. Each returns False, or sets its stop event, once the work should stop (cancel
requested, or this worker no longer owns it). Every write is retried through a database outage
(worker.dbretry)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from app.jobs import parts as part_state
from app.jobs import state
from worker.config import RunnerConfig
from worker.dbretry import SessionFactory, retry_db

# Progress and heartbeat records go out under the runner's logger name, wherever written.
log = logging.getLogger("worker.runner")


class ProgressWriter:
    """The engine's progress callback: writes stage/done/total (and so the heartbeat) to the
    job row, at most every `min_interval` seconds within a stage, and returns False once the
    job should stop (cancel requested, or this worker no longer owns the job)."""

    def __init__(
        self,
        sessions: SessionFactory,
        job_id: str,
        worker_id: str,
        *,
        min_interval: float = 0.5,
        layer_delay: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        db_retry_s: float = 300.0,
    ) -> None:
        self.sessions = sessions
        self.db_retry_s = db_retry_s
        self.job_id = job_id
        self.worker_id = worker_id
        self.min_interval = min_interval
        self.layer_delay = layer_delay
        self.clock = clock
        self.sleep = sleep
        self.stop = threading.Event()
        self.last: tuple[str, int, int] = ("", 0, 0)
        self._last_write = -1e18
        self._lock = threading.Lock()
        # Called first on every progress call; raises to stop the attempt (worker.scratch's
        # disk quota). None: nothing to check.
        self.guard: Callable[[str, int, int], None] | None = None

    def write(self, stage: str, done: int, total: int) -> bool:
        def once() -> bool:
            with self.sessions() as s:
                return state.record_progress(
                    s, self.job_id, stage, done, total, worker_id=self.worker_id
                )

        # Through a database outage the engine waits here (retrying), then goes on.
        go = self._ask(once, f"progress of job {self.job_id}")
        self._last_write = self.clock()
        return go

    def _ask(self, once: Callable[[], bool], what: str) -> bool:
        """One record through retry_db (one at a time); a False answer (stop) sets `stop`."""
        with self._lock:
            go = retry_db(once, what, self.db_retry_s)
        if not go:
            self.stop.set()
        return go

    def __call__(self, stage: str, done: int, total: int) -> bool:
        if self.stop.is_set():
            return False
        if self.guard is not None:
            self.guard(stage, done, total)
        changed = stage != self.last[0]
        self.last = (stage, done, total)
        due = self.clock() - self._last_write >= self.min_interval
        if (changed or due or done >= total) and not self.write(stage, done, total):
            return False
        if self.layer_delay and stage in ("quantizing", "profiling") and done > 0:
            self.sleep(self.layer_delay)
        return not self.stop.is_set()

    def beat(self) -> None:
        """A heartbeat between progress calls (long loads, long layers)."""

        def once() -> bool:
            with self.sessions() as s:
                return state.heartbeat(s, self.job_id, worker_id=self.worker_id)

        self._ask(once, f"heartbeat of job {self.job_id}")


class PartProgress(ProgressWriter):
    """The engine's progress callback for one part: the part row's progress and heartbeat,
    summed into the job's; False once the part should stop."""

    def __init__(
        self,
        sessions: SessionFactory,
        job_id: str,
        attempt: int,
        idx: int,
        worker_id: str,
        cfg: RunnerConfig,
    ) -> None:
        super().__init__(
            sessions,
            job_id,
            worker_id,
            min_interval=cfg.progress_min_interval_s,
            layer_delay=cfg.debug_layer_delay_s,
            db_retry_s=cfg.db_retry_s,
        )
        self.attempt = attempt
        self.idx = idx

    def _record(self, done: int | None, total: int | None) -> bool:
        def once() -> bool:
            with self.sessions() as s:
                return part_state.record_part_progress(
                    s, self.job_id, self.attempt, self.idx, self.worker_id, done, total
                )

        return self._ask(once, f"progress of job {self.job_id} part {self.idx}")

    def write(self, stage: str, done: int, total: int) -> bool:
        go = self._record(done, total) if stage == "quantizing" else self._record(None, None)
        self._last_write = self.clock()
        return go

    def beat(self) -> None:
        self._record(None, None)


@contextlib.contextmanager
def heartbeating(writer: ProgressWriter, interval: float) -> Iterator[None]:
    """Run writer.beat() every `interval` seconds in a daemon thread while the block runs."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(interval):
            try:
                writer.beat()
            except Exception as e:  # a missed beat is not fatal; the next one may work
                log.warning("heartbeat for job %s failed: %s", writer.job_id, e)

    t = threading.Thread(target=loop, name=f"heartbeat-{writer.job_id}", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join(timeout=5)
