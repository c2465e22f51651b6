"""A daemon thread that does one step right away and then one every `interval` seconds until
stopped: the shape of the worker main process's background loops (sweep, webhook dispatch)."""

from __future__ import annotations

import threading


class PeriodicThread:
    """Subclasses implement tick(); it must not raise (log and try again next time)."""

    def __init__(self, name: str, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def tick(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        # First step right away: a restarted worker picks up what its predecessor left.
        while True:
            self.tick()
            if self._stop.wait(self.interval):
                return
