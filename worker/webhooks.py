"""The webhook dispatcher thread of a worker's main process (app.webhooks.service does the
work): deliveries never run inside a job, so a receiver that is down or slow cannot delay or
fail one. Several workers may dispatch at once (every step is a compare-and-set)."""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from app.webhooks.service import dispatch_once
from worker.periodic import PeriodicThread

log = logging.getLogger("worker.webhooks")


class WebhookThread(PeriodicThread):
    """dispatch_once() every settings.webhook_interval_s in a daemon thread."""

    def __init__(self, sessions: sessionmaker[Session], settings: Settings) -> None:
        super().__init__("higgs-webhooks", settings.webhook_interval_s)
        self.sessions = sessions
        self.settings = settings

    def tick(self) -> None:
        try:
            counts = dispatch_once(self.sessions, self.settings)
            if counts["sent"] or counts["made"]:
                log.info("webhooks: %s", counts)
        except Exception as e:  # the database may be briefly away; try again later
            log.warning("webhook dispatch failed: %s", e)
