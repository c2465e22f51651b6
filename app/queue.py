"""A light Celery client: the API enqueues job ids by task NAME (it never imports worker/).

Called only after the job row is committed; if the broker is down the job stays with
enqueued_at = NULL and the worker's periodic sweep sends it later, so no accepted job is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from celery import Celery
from kombu.connection import Connection

from app.settings import TASK_NAME, Settings

log = logging.getLogger(__name__)


def client_transport_options(settings: Settings) -> dict[str, Any]:
    """The broker transport options of the API's connections: for Redis, socket timeouts, so a
    broker that accepts connections but does not answer (frozen, overloaded) fails a send or a
    check after settings.broker_timeout_s instead of holding the request forever."""
    opts = dict(settings.broker_transport_options())
    if settings.broker_url.startswith(("redis://", "rediss://")):
        opts.setdefault("socket_timeout", settings.broker_timeout_s)
        opts.setdefault("socket_connect_timeout", settings.broker_timeout_s)
    return opts


@lru_cache(maxsize=8)
def _client(broker_url: str, options_key: tuple[tuple[str, Any], ...], timeout: float) -> Celery:
    app = Celery("higgs-api", broker=broker_url, set_as_current=False)
    app.conf.update(
        broker_transport_options=dict(options_key),
        broker_connection_timeout=timeout,
        broker_connection_retry_on_startup=False,
        task_serializer="json",
        accept_content=["json"],
    )
    return app


def celery_client(settings: Settings) -> Celery:
    opts = tuple(sorted(client_transport_options(settings).items()))
    return _client(settings.broker_url, opts, settings.broker_timeout_s)


def enqueue_job(settings: Settings, job_id: str, queue: str | None = None) -> bool:
    """Send "higgs.run_job"(job_id) to the queue; False (logged) when the broker is unreachable."""
    if settings.is_filesystem_broker:
        settings.ensure_dirs()
    try:
        celery_client(settings).send_task(
            TASK_NAME,
            args=[job_id],
            queue=queue or settings.task_queue,
            retry=True,
            retry_policy={"max_retries": 2, "interval_start": 0.1, "interval_step": 0.2},
        )
    except Exception as e:  # any broker failure: the sweep re-sends, the request still succeeds
        log.warning("could not enqueue job %s: %s", job_id, e)
        return False
    return True


@contextmanager
def _connected(settings: Settings) -> Iterator[Connection]:
    """A kombu connection to the broker, established (one try, settings.broker_timeout_s)."""
    with Connection(  # type: ignore[no-untyped-call]
        settings.broker_url,
        transport_options=client_transport_options(settings),
        connect_timeout=settings.broker_timeout_s,
    ) as conn:
        conn.ensure_connection(
            max_retries=1, interval_start=0, interval_step=0, timeout=settings.broker_timeout_s
        )
        yield conn


def check_broker(settings: Settings) -> None:
    """Raise if the broker cannot be reached within settings.broker_timeout_s."""
    if settings.is_filesystem_broker:
        opts = settings.broker_transport_options()
        for key in ("data_folder_in", "control_folder"):
            if not Path(opts[key]).is_dir():
                raise ConnectionError(f"broker folder {opts[key]} does not exist")
        return
    with _connected(settings) as conn:
        # For Redis, kombu's channel setup sends a PING: a real round trip.
        _ = conn.default_channel


def queue_depth(settings: Settings, queue: str | None = None) -> int | None:
    """Messages waiting in the broker queue, or None when it cannot be read cheaply."""
    try:
        with _connected(settings) as conn:
            channel: Any = conn.default_channel
            size = channel._size(queue or settings.task_queue)  # kombu virtual transports
            return int(size)
    except Exception:
        return None
