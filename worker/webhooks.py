"""The webhook dispatcher thread of a worker's main process (app.webhooks.service does the
work): deliveries never run inside a job, so a receiver that is down or slow cannot delay or
fail one. Each tick starts the due deliveries in the dispatcher's own thread pool and returns at
once: a slow receiver holds one of its key's slots until its deadline, not the dispatcher.
Several workers may dispatch at once (every step is a compare-and-set)."""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from app.webhooks.service import Dispatcher
from worker.periodic import PeriodicThread

log = logging.getLogger("worker.webhooks")


class WebhookThread(PeriodicThread):
    """Dispatcher.tick() every settings.webhook_interval_s in a daemon thread."""

    def __init__(self, sessions: sessionmaker[Session], settings: Settings) -> None:
        super().__init__("higgs-webhooks", settings.webhook_interval_s)
        self.dispatcher = Dispatcher(sessions, settings)

    def tick(self) -> None:
        try:
            counts = self.dispatcher.tick()
            if counts["sent"] or counts["made"]:
                log.info("webhooks: %s", counts)
        except Exception as e:  # the database may be briefly away; try again later
            log.warning("webhook dispatch failed: %s", e)

    def stop(self, timeout: float = 5.0) -> None:
        super().stop(timeout)
        self.dispatcher.close()
