"""The checks behind /readyz, run in the background and cached.

Each dependency's check (database, broker, artifact store) runs in a daemon thread of its own,
at most one at a time per dependency; its result is reused for `cache_s`. A /readyz request
starts the checks whose result is older than that and waits at most `timeout_s` for them. A
dependency that has not answered by then (a frozen Redis or PostgreSQL accepts the connection
and never replies) is reported unavailable; while its check is still hanging, later requests
wait (up to `timeout_s`) for that same check instead of starting another. So a hung dependency
costs /readyz at most `timeout_s`, never one blocked thread per request, and the answer turns
ready as soon as the dependency answers the check in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger("app.ops")

OK, UNAVAILABLE = "ok", "unavailable"


def _describe(exc: BaseException) -> str:
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"


@dataclass
class _State:
    ok: bool = False
    finished_at: float | None = None  # monotonic time of the last result
    running_since: float | None = None  # monotonic start of the check in flight


class Readiness:
    def __init__(
        self, checks: Mapping[str, Callable[[], None]], *, timeout_s: float, cache_s: float
    ) -> None:
        self.checks = dict(checks)
        self.timeout_s = timeout_s
        self.cache_s = cache_s
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._state = {name: _State() for name in self.checks}

    def _run(self, name: str) -> None:
        try:
            self.checks[name]()
            ok = True
        except Exception as e:  # which dependency failed goes out; how goes to the log
            log.warning("readyz: %s check failed: %s", name, _describe(e))
            ok = False
        with self._lock:
            st = self._state[name]
            st.ok, st.finished_at, st.running_since = ok, time.monotonic(), None
            self._done.notify_all()

    def _fresh(self, st: _State, now: float) -> bool:
        return st.finished_at is not None and now - st.finished_at <= self.cache_s

    def results(self) -> dict[str, str]:
        """{dependency: "ok" | "unavailable"}, within about timeout_s."""
        start = time.monotonic()
        with self._lock:
            for name, st in self._state.items():
                if st.running_since is None and not self._fresh(st, start):
                    st.running_since = start
                    threading.Thread(
                        target=self._run, args=(name,), name=f"readyz-{name}", daemon=True
                    ).start()

            def settled() -> bool:
                return all(
                    st.running_since is None and st.finished_at is not None
                    for st in self._state.values()
                )

            self._done.wait_for(settled, self.timeout_s)
            out: dict[str, str] = {}
            for name, st in self._state.items():
                answered = st.running_since is None and st.finished_at is not None
                if not answered:
                    log.warning("readyz: %s check gave no answer within %gs", name, self.timeout_s)
                out[name] = OK if answered and st.ok else UNAVAILABLE
            return out
