"""The Celery application of the worker, built from the service Settings.

    celery -A worker.celery_app worker -Q higgs,higgs.gpu --concurrency 1

- Late acknowledgement + reject on worker loss: a job whose worker dies is redelivered (on
  Redis after the visibility timeout; sooner through the heartbeat sweep); the runner's
  compare-and-set claim makes a duplicate delivery a no-op.
- Prefetch 1: a worker holds at most the job it runs.
- Soft/hard time limits from the settings (the soft one fails the job with "time_limit").
- Queues "higgs" (every worker) and "higgs.gpu" (workers with a GPU consume it as well).
- The sweep runs in a thread of each worker's main process every settings.sweep_interval_s
  (HIGGS_SWEEP_INTERVAL_S); `celery -A worker.celery_app call higgs.sweep` runs one by hand.
- Webhook events are made and delivered by another thread of the main process
  (worker/webhooks.py), outside every job.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from typing import Any

from celery import Celery, signals
from kombu import Queue
from sqlalchemy.orm import Session, sessionmaker

from app.db.session import create_db_engine, session_factory
from app.settings import DEFAULT_QUEUE, GPU_QUEUE, TASK_NAME, Settings, get_settings

log = logging.getLogger("worker")

SWEEP_TASK = "higgs.sweep"
PART_TASK = "higgs.run_part"
ASSEMBLE_TASK = "higgs.assemble"


def broker_options(settings: Settings) -> dict[str, Any]:
    opts = dict(settings.broker_transport_options())
    if settings.is_filesystem_broker:
        # The filesystem transport polls its folder: a short interval keeps submit -> start
        # near 0.1 s for the price of a listdir of a nearly empty folder.
        opts.setdefault("polling_interval", 0.1)
    if settings.broker_url.startswith(("redis://", "rediss://")):
        # An unacknowledged job comes back after this long. Longer than the hard time limit,
        # so a live job is never delivered twice; a dead worker's job is re-queued much
        # sooner by the heartbeat sweep anyway.
        opts.setdefault("visibility_timeout", settings.job_time_limit_s + 600)
    return opts


def make_celery(settings: Settings) -> Celery:
    if settings.is_filesystem_broker:
        settings.ensure_dirs()
    app = Celery("higgs", broker=settings.broker_url, include=["worker.tasks"])
    app.conf.update(
        broker_transport_options=broker_options(settings),
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        accept_content=["json"],
        # Nothing reads task results: the job row is the source of truth.
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=settings.worker_concurrency,
        task_soft_time_limit=settings.job_soft_time_limit_s,
        task_time_limit=settings.job_time_limit_s,
        task_default_queue=settings.task_queue,
        task_queues=(Queue(DEFAULT_QUEUE), Queue(GPU_QUEUE)),
        task_routes={SWEEP_TASK: {"queue": settings.task_queue}},
        worker_hijack_root_logger=False,
        # The server-less filesystem transport has no fan-out for remote control.
        worker_enable_remote_control=not settings.is_filesystem_broker,
        worker_send_task_events=False,
        # A pool process is replaced after a job that left it bigger than this (a profiled
        # model, allocator fragmentation): ordinary jobs reuse a warm process, with no fork
        # and re-initialisation between a job's submit and its start.
        worker_max_memory_per_child=settings.worker_max_memory_mb * 1024,  # KiB
    )
    if settings.broker_url.startswith(("redis://", "rediss://")):
        # Only the parts of a fanned-out job keep a result: their chord is counted here.
        app.conf.update(result_backend=settings.broker_url, result_expires=7 * 24 * 3600)
    app.conf.higgs_settings = settings
    return app


# ---------------------------------------------------------------- per-process resources


_SESSIONS: dict[tuple[str, int], sessionmaker[Session]] = {}


def sessions_for(settings: Settings) -> sessionmaker[Session]:
    """This process's session factory (keyed by pid: a forked pool process must never use
    its parent's pooled connections)."""
    key = (settings.database_url, os.getpid())
    if key not in _SESSIONS:
        _SESSIONS[key] = session_factory(create_db_engine(settings.database_url))
    return _SESSIONS[key]


def forget_parent_connections() -> None:
    """In a forked child: drop the parent's pools without closing the parent's sockets."""
    for key, sessions in list(_SESSIONS.items()):
        if key[1] != os.getpid():
            engine = sessions.kw.get("bind")
            if engine is not None:
                engine.dispose(close=False)
            del _SESSIONS[key]


@lru_cache(maxsize=4)
def detect_device(wanted: str = "auto") -> str:
    """The device jobs run on: settings.device ("auto": CUDA when usable, else the CPU).
    A CUDA device that is asked for but unusable is logged as an error and the CPU is used:
    jobs run slower rather than fail. Logged once per process."""
    try:
        import torch

        from higgs_engine.device import resolve_device

        device = str(resolve_device(wanted))
        detail = (
            torch.cuda.get_device_name(torch.device(device))
            if device.startswith("cuda")
            else f"{os.cpu_count()} CPUs"
        )
    except Exception as e:  # torch missing, broken CUDA, or no such device: say why
        log.error("higgs worker: device %r is not usable (%s); using the CPU", wanted, e)
        device, detail = "cpu", f"fallback from {wanted!r}"
    log.info("higgs worker device: %s (%s)", device, detail)
    return device


def enqueue(settings: Settings, job_id: str) -> bool:
    """Send higgs.run_job(job_id) (the same light client the API uses)."""
    from app.queue import enqueue_job

    return enqueue_job(settings, job_id)


def broker_depth(settings: Settings) -> int | None:
    """Messages waiting in the job queues (None when the broker cannot tell)."""
    from app.queue import queue_depth

    total = 0
    for queue in dict.fromkeys([settings.task_queue, DEFAULT_QUEUE, GPU_QUEUE]):
        n = queue_depth(settings, queue)
        if n is None:
            return None
        total += n
    return total


def send_task(settings: Settings, name: str, args: list[Any]) -> bool:
    """Send a task of this app by name; False (logged) when the broker cannot be reached."""
    try:
        app.send_task(name, args=args, queue=settings.task_queue)
    except Exception as e:
        log.warning("could not send %s%s: %s", name, tuple(args), e)
        return False
    return True


def sweep_once(settings: Settings, requeue_stale: bool = True) -> dict[str, list[str]]:
    from worker.models import register_local_models
    from worker.sweep import sweep, sweep_fanout

    # The API accepts local model names from these rows (it needs no models folder itself).
    register_local_models(sessions_for(settings), settings.models_dir)

    out = sweep(
        sessions_for(settings),
        settings,
        lambda job_id: enqueue(settings, job_id),
        lambda: broker_depth(settings),
        requeue_stale=requeue_stale,
    ).as_dict()
    out.update(
        sweep_fanout(
            sessions_for(settings),
            settings,
            lambda job_id, attempt, idx: send_task(settings, PART_TASK, [job_id, attempt, idx]),
            lambda job_id, attempt: send_task(settings, ASSEMBLE_TASK, [None, job_id, attempt]),
            requeue_stale=requeue_stale,
        )
    )
    return out


# ---------------------------------------------------------------- the app

app = make_celery(get_settings())
_sweeper: Any = None
_webhooks: Any = None


@signals.worker_ready.connect
def _start_sweep(sender: Any = None, **_: Any) -> None:
    global _sweeper, _webhooks
    from worker.sweep import SweepThread
    from worker.webhooks import WebhookThread

    settings: Settings = app.conf.higgs_settings
    _sweeper = SweepThread(
        lambda requeue_stale: sweep_once(settings, requeue_stale),
        settings.sweep_interval_s,
        outage_grace_s=settings.heartbeat_timeout_s,
    )
    _sweeper.start()
    _webhooks = WebhookThread(sessions_for(settings), settings)
    _webhooks.start()
    log.info(
        "higgs worker ready: broker %s, database %s, artifacts %s, sweep every %gs",
        settings.broker_url.split("@")[-1],
        settings.database_url.split("@")[-1],
        settings.artifacts_path,
        settings.sweep_interval_s,
    )


def preload_engine() -> None:
    """Import torch, transformers' model code and the engine (~seconds to tens of seconds)."""
    try:
        import transformers.modeling_utils  # noqa: F401

        import higgs_engine.pipeline  # noqa: F401
    except Exception as e:  # the job itself will report a clear error
        log.warning("could not preload the engine: %s", e)


@signals.worker_init.connect
def _preload_in_main_process(**_: Any) -> None:
    # Import the heavy modules once, before the pool forks: a replaced pool process then
    # starts in milliseconds. Importing torch does not initialise CUDA, so forking afterwards
    # is safe; CUDA is touched only in the pool processes (detect_device below).
    preload_engine()


@signals.worker_process_init.connect
def _pool_process_init(**_: Any) -> None:
    forget_parent_connections()
    detect_device(app.conf.higgs_settings.device)


@signals.worker_shutdown.connect
def _stop_sweep(sender: Any = None, **_: Any) -> None:
    if _sweeper is not None:
        _sweeper.stop()
    if _webhooks is not None:
        _webhooks.stop()


__all__ = ["SWEEP_TASK", "TASK_NAME", "app", "detect_device", "make_celery", "sessions_for"]
