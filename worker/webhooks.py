"""The webhook dispatcher thread of a worker's main process (app.webhooks.service does the
work): deliveries never run inside a job, so a receiver that is down or slow cannot delay or
fail one. Several workers may dispatch at once (every step is a compare-and-set)."""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from app.webhooks.service import dispatch_once

log = logging.getLogger("worker.webhooks")


class WebhookThread:
    """dispatch_once() every settings.webhook_interval_s in a daemon thread."""

    def __init__(self, sessions: sessionmaker[Session], settings: Settings) -> None:
        self.sessions = sessions
        self.settings = settings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="higgs-webhooks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                counts = dispatch_once(self.sessions, self.settings)
                if counts["sent"] or counts["made"]:
                    log.info("webhooks: %s", counts)
            except Exception as e:  # the database may be briefly away; try again later
                log.warning("webhook dispatch failed: %s", e)
            self._stop.wait(self.settings.webhook_interval_s)
