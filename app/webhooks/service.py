"""Webhook secrets, the deliveries of a job, and the dispatcher that makes and sends events.

The dispatcher (`Dispatcher`) runs in a thread of each worker's main process
(worker/webhooks.py), never inside a job: a receiver that is down or slow never delays a job.
Each tick it

1. makes one event (a `webhook_deliveries` row) for every job that reached a terminal state,
   has a webhook_url and has no event yet (the unique (job_id, event) constraint lets several
   workers race safely);
2. claims due deliveries with a compare-and-set on (attempts, next_attempt_at), as many as
   there are free slots (HIGGS_WEBHOOK_CONCURRENCY) and at most
   HIGGS_WEBHOOK_PER_KEY_CONCURRENCY per API key, and starts them without waiting: each POSTs
   signed (app.webhooks.signing) within a total deadline (app.webhooks.post) and records the
   outcome: 2xx = delivered; anything else is retried with exponential backoff until the event
   is older than the retry window or the attempts are used up, then failed. A slow receiver
   thus holds at most its own key's slots, never another tenant's deliveries.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from app.db.base import utcnow
from app.db.models import TERMINAL, ApiKey, Job, WebhookDelivery
from app.errors import NotFoundError
from app.settings import Settings
from app.webhooks.post import POST_ERRORS, post
from app.webhooks.signing import EVENT_ID_HEADER, SIGNATURE_HEADER, new_secret, sign
from app.webhooks.urls import WebhookUrlError, checked_addresses, pin

log = logging.getLogger("app.webhooks")

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
MAX_ERROR_CHARS = 500
MAX_LOG_ENTRIES = 50
USER_AGENT = "higgs-webhooks/1"
# Of a receiver's answer only the status counts: at most this much of its body is read.
MAX_ANSWER_BYTES = 4096


# ---------------------------------------------------------------- secrets


def _key_row(session: Session, key_id: str) -> ApiKey:
    row = session.get(ApiKey, key_id)
    if row is None:
        raise NotFoundError(f"API key {key_id!r} does not exist")
    return row


def secret_of(session: Session, key_id: str) -> str:
    """The key's webhook secret, made (and committed) on first use."""
    row = _key_row(session, key_id)
    if row.webhook_secret is None:
        row.webhook_secret = new_secret()
        session.commit()
    return row.webhook_secret


def rotate_secret(session: Session, key_id: str) -> str:
    """A new secret for the key; deliveries from now on (retries included) are signed with it."""
    row = _key_row(session, key_id)
    row.webhook_secret = new_secret()
    session.commit()
    return row.webhook_secret


# ---------------------------------------------------------------- views


def delivery_view(d: WebhookDelivery) -> dict[str, Any]:
    return {
        "id": d.id,
        "event": d.event,
        "url": d.url,
        "state": d.state,
        "attempts": d.attempts,
        "next_attempt_at": d.next_attempt_at if d.state == PENDING else None,
        "last_status_code": d.last_status_code,
        "last_error": d.last_error,
        "created_at": d.created_at,
        "delivered_at": d.delivered_at,
        "attempt_log": list(d.attempt_log or []),
        "payload": d.payload,
    }


def deliveries_of(session: Session, job_id: str) -> list[WebhookDelivery]:
    return list(
        session.scalars(
            select(WebhookDelivery)
            .where(WebhookDelivery.job_id == job_id)
            .order_by(WebhookDelivery.created_at)
        )
    )


# ---------------------------------------------------------------- events


def event_payload(job: Job, event_id: str, now: datetime) -> dict[str, Any]:
    return {
        "id": event_id,
        "type": f"job.{job.status}",
        "created_at": now.isoformat(),
        "job_id": job.id,
        "status": job.status,
        "model": {"id": job.model_id, "resolved_revision": job.model_revision},
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        "summary": job.summary,
        "error": {"code": job.error_code, "message": job.error_message or ""}
        if job.error_code
        else None,
        "url": f"/v1/jobs/{job.id}",
    }


def make_events(session: Session, settings: Settings, now: datetime | None = None) -> list[str]:
    """An event row for each terminal job with a webhook_url and no event yet; their ids."""
    now = now or utcnow()
    horizon = now - timedelta(seconds=settings.webhook_event_horizon_s)
    has_event = select(WebhookDelivery.id).where(WebhookDelivery.job_id == Job.id).exists()
    jobs = list(
        session.scalars(
            select(Job)
            .where(
                Job.webhook_url.is_not(None),
                Job.status.in_(sorted(TERMINAL)),
                Job.finished_at >= horizon,
                ~has_event,
            )
            .order_by(Job.finished_at)
            .limit(200)
        )
    )
    made: list[str] = []
    for job in jobs:
        event_id = str(uuid.uuid4())
        row = WebhookDelivery(
            id=event_id,
            job_id=job.id,
            event=f"job.{job.status}",
            url=str(job.webhook_url),
            payload=event_payload(job, event_id, now),
            state=PENDING,
            attempts=0,
            next_attempt_at=now,
            attempt_log=[],
            created_at=now,
            updated_at=now,
        )
        session.add(row)
        try:
            session.commit()
            made.append(event_id)
        except IntegrityError:  # another dispatcher made it first
            session.rollback()
    session.rollback()
    return made


# ---------------------------------------------------------------- delivering


@dataclass(frozen=True)
class Claimed:
    id: str
    key_id: str  # the API key whose job it is (deliveries in flight are capped per key)
    url: str
    body: bytes
    secret: str
    attempt: int  # 1-based number of this try
    created_at: datetime


@dataclass(frozen=True)
class Outcome:
    status_code: int | None
    error: str | None
    duration_ms: float

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def backoff_s(settings: Settings, attempt: int) -> float:
    """Seconds to wait after failed try number `attempt` (1-based): doubling, capped."""
    return float(
        min(settings.webhook_backoff_max_s, settings.webhook_backoff_s * 2 ** (attempt - 1))
    )


def claim_due(
    session: Session,
    settings: Settings,
    now: datetime,
    limit: int,
    busy: Mapping[str, int] | None = None,
) -> list[Claimed]:
    """Up to `limit` due pending deliveries, oldest first, at most
    settings.webhook_per_key_concurrency per API key counting the key's deliveries already in
    flight (`busy`), so one tenant's backlog cannot take every slot. Each is claimed by bumping
    attempts and pushing next_attempt_at past the delivery deadline (so another dispatcher does
    not send it meanwhile)."""
    busy = dict(busy or {})
    per_key = settings.webhook_per_key_concurrency
    rank = (
        func.row_number()
        .over(
            partition_by=Job.api_key_id,
            order_by=(WebhookDelivery.next_attempt_at, WebhookDelivery.id),
        )
        .label("rank")
    )
    due = (
        select(WebhookDelivery.id, WebhookDelivery.next_attempt_at, Job.api_key_id, rank)
        .join(Job, Job.id == WebhookDelivery.job_id)
        .where(WebhookDelivery.state == PENDING, WebhookDelivery.next_attempt_at <= now)
        .subquery()
    )
    candidates = session.execute(
        select(due.c.id, due.c.api_key_id)
        .where(due.c.rank <= per_key)
        .order_by(due.c.next_attempt_at, due.c.id)
        .limit(limit + per_key * len(busy))
    ).all()
    session.rollback()
    lease = now + timedelta(seconds=settings.webhook_timeout_s * 2 + 5)
    out: list[Claimed] = []
    for delivery_id, key_id in candidates:
        if len(out) >= limit:
            break
        if busy.get(key_id, 0) >= per_key:
            continue
        d = session.get(WebhookDelivery, delivery_id)
        if d is None or d.state != PENDING:
            session.rollback()
            continue
        attempts, url, created_at = d.attempts, d.url, d.created_at
        body = json.dumps(d.payload, separators=(",", ":"), sort_keys=True).encode()
        res = session.execute(
            update(WebhookDelivery)
            .where(
                WebhookDelivery.id == delivery_id,
                WebhookDelivery.state == PENDING,
                WebhookDelivery.attempts == attempts,
            )
            .values(attempts=attempts + 1, next_attempt_at=lease, updated_at=now)
            .execution_options(synchronize_session=False)
        )
        if getattr(res, "rowcount", 0) != 1:
            session.rollback()
            continue
        secret = secret_of(session, key_id)  # commits the claim (and a first secret)
        session.commit()
        out.append(Claimed(delivery_id, key_id, url, body, secret, attempts + 1, created_at))
        busy[key_id] = busy.get(key_id, 0) + 1
    return out


def send(claimed: Claimed, settings: Settings) -> Outcome:
    """One signed POST, over within settings.webhook_timeout_s of wall time whatever the
    receiver does (app.webhooks.post). Redirects are not followed and at most
    MAX_ANSWER_BYTES of the answer are read; the URL is checked again first (its host may
    resolve elsewhere now) and the connection goes to the address that passed it."""
    t0 = time.monotonic()
    try:
        addresses = checked_addresses(claimed.url, allow_private=settings.webhook_allow_private)
        target = pin(claimed.url, addresses[0]) if addresses else None
        code: int | None = post(
            target.url if target else claimed.url,
            claimed.body,
            {
                **(target.headers if target else {}),
                "Content-Type": "application/json",
                "User-Agent": USER_AGENT,
                SIGNATURE_HEADER: sign(claimed.secret, claimed.body),
                EVENT_ID_HEADER: claimed.id,
                "Higgs-Delivery-Attempt": str(claimed.attempt),
            },
            total_s=settings.webhook_timeout_s,
            max_answer_bytes=MAX_ANSWER_BYTES,
            sni_hostname=target.extensions.get("sni_hostname") if target else None,
        )
        err = None if code is not None and 200 <= code < 300 else f"HTTP {code}"
    except WebhookUrlError as e:
        code, err = None, str(e)
    except POST_ERRORS as e:
        code, err = None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return Outcome(code, err[:MAX_ERROR_CHARS] if err else None, (time.monotonic() - t0) * 1e3)


def record(
    session: Session, settings: Settings, claimed: Claimed, outcome: Outcome, now: datetime
) -> str:
    """Store the outcome of a try; returns the delivery's new state."""
    d = session.get(WebhookDelivery, claimed.id, populate_existing=True)
    if d is None:  # the job (and with it the delivery) was deleted meanwhile
        session.rollback()
        return FAILED
    entry = {
        "attempt": claimed.attempt,
        "at": now.isoformat(),
        "status_code": outcome.status_code,
        "error": outcome.error,
        "duration_ms": round(outcome.duration_ms, 1),
    }
    d.attempt_log = [*(d.attempt_log or []), entry][-MAX_LOG_ENTRIES:]
    d.last_status_code = outcome.status_code
    d.last_error = outcome.error
    d.updated_at = now
    if outcome.ok:
        d.state, d.delivered_at, d.next_attempt_at = DELIVERED, now, None
    else:
        retry_at = now + timedelta(seconds=backoff_s(settings, claimed.attempt))
        window_end = claimed.created_at + timedelta(seconds=settings.webhook_retry_window_s)
        if claimed.attempt >= settings.webhook_max_attempts or retry_at > window_end:
            d.state, d.next_attempt_at = FAILED, None
        else:
            d.next_attempt_at = retry_at
    session.commit()
    return d.state


class Dispatcher:
    """Makes events and starts due deliveries without waiting for them: each `tick` claims
    what fits in the free slots (settings.webhook_concurrency in flight, at most
    settings.webhook_per_key_concurrency of them per API key) and hands each to a thread of
    its pool, which sends it and records the outcome. A receiver that is slow (up to the
    deadline of settings.webhook_timeout_s) holds one slot of its own key; other keys'
    deliveries start on the next tick."""

    def __init__(self, sessions: sessionmaker[Session], settings: Settings) -> None:
        self.sessions = sessions
        self.settings = settings
        self._pool = ThreadPoolExecutor(
            max_workers=settings.webhook_concurrency, thread_name_prefix="higgs-webhook"
        )
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight: dict[str, str] = {}  # delivery id -> API key id
        self.recorded: Counter[str] = Counter()

    def in_flight(self) -> dict[str, int]:
        """Deliveries being sent now, by API key id."""
        with self._lock:
            return dict(Counter(self._in_flight.values()))

    def tick(self) -> dict[str, int]:
        """Make due events and start due deliveries; counts of both."""
        now = utcnow()
        with self.sessions() as s:
            made = make_events(s, self.settings, now)
        busy = self.in_flight()
        free = self.settings.webhook_concurrency - sum(busy.values())
        claimed: list[Claimed] = []
        if free > 0:
            with self.sessions() as s:
                claimed = claim_due(s, self.settings, now, free, busy)
        for c in claimed:
            with self._lock:
                self._in_flight[c.id] = c.key_id
            self._pool.submit(self._deliver, c)
        return {"made": len(made), "sent": len(claimed)}

    def _deliver(self, c: Claimed) -> None:
        try:
            outcome = send(c, self.settings)
            with self.sessions() as s:
                new_state = record(s, self.settings, c, outcome, utcnow())
            with self._lock:
                self.recorded[new_state] += 1
            if not outcome.ok:
                log.info(
                    "webhook %s try %d to %s: %s -> %s",
                    c.id, c.attempt, c.url, outcome.error, new_state,
                )  # fmt: skip
        except Exception as e:  # the database may be away: the claim's lease runs out, retried
            log.warning("webhook %s try %d not recorded: %s", c.id, c.attempt, e)
        finally:
            with self._lock:
                self._in_flight.pop(c.id, None)
                self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no delivery is in flight; False when timeout ran out first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._in_flight, timeout)

    def close(self, wait: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)


def dispatch_once(sessions: sessionmaker[Session], settings: Settings) -> dict[str, int]:
    """Make due events, send the due deliveries that fit (concurrently, capped per key as in
    Dispatcher) and wait for their outcomes; counts of what happened."""
    dispatcher = Dispatcher(sessions, settings)
    try:
        counts = dispatcher.tick()
        dispatcher.wait_idle()
    finally:
        dispatcher.close(wait=True)
    return {**counts, DELIVERED: 0, PENDING: 0, FAILED: 0, **dispatcher.recorded}
