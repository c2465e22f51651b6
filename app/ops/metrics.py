"""Prometheus metrics: request latency (middleware) plus job figures read from the database
at scrape time, so every API process reports the same, cross-process truth.

With several API processes (uvicorn --workers, several containers on one volume) set
PROMETHEUS_MULTIPROC_DIR to an empty folder shared by them before they start (`higgs serve`
does; the compose file mounts a tmpfs): prometheus_client's multiprocess mode then keeps each
process's latency histogram in files there, and a scrape of any process sums them all.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, multiprocess
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.db.models import STATUSES
from app.jobs import repository
from app.queue import queue_depth
from app.settings import Settings

RECENT_JOBS = 200
# The method label: these, or "other" (made-up methods must not create series).
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class JobCollector(Collector):
    def __init__(self, sessions: sessionmaker[Session], settings: Settings) -> None:
        self.sessions = sessions
        self.settings = settings

    def collect(self) -> Iterable[Metric]:
        jobs = GaugeMetricFamily("higgs_jobs", "Jobs in the database by status", labels=["status"])
        stage = GaugeMetricFamily(
            "higgs_recent_stage_duration_seconds",
            f"Stage durations over the last {RECENT_JOBS} finished jobs",
            labels=["stage", "stat"],
        )
        with self.sessions() as s:
            counts = repository.counts_by_status(s)
            recent = repository.recent_stage_durations(s, RECENT_JOBS)
        for status in STATUSES:
            jobs.add_metric([status], counts.get(status, 0))
        yield jobs
        by_stage: dict[str, list[float]] = {}
        for row in recent:
            for name, secs in row.items():
                by_stage.setdefault(name, []).append(float(secs))
        for name, values in sorted(by_stage.items()):
            stage.add_metric([name, "mean"], statistics.fmean(values))
            stage.add_metric([name, "p50"], statistics.median(values))
            stage.add_metric([name, "max"], max(values))
            stage.add_metric([name, "count"], len(values))
        yield stage
        depth = queue_depth(self.settings)
        q = GaugeMetricFamily(
            "higgs_queue_depth",
            "Messages waiting in the broker queue (-1: broker unreadable)",
            labels=["queue"],
        )
        q.add_metric([self.settings.task_queue], -1 if depth is None else depth)
        yield q


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str | None:
    """The folder of prometheus_client's multiprocess mode, None when it is off. It must be
    set before prometheus_client is first imported (the process's environment at start)."""
    return os.environ.get(MULTIPROC_ENV) or None


def build_registry(
    sessions: sessionmaker[Session], settings: Settings
) -> tuple[CollectorRegistry, Histogram]:
    """The registry a scrape reads, and the latency histogram. A registry per app (not the
    global one), so several apps can live in one process. In multiprocess mode the histogram
    belongs to no registry: its values go to the shared folder, and the scrape registry reads
    every process's files from there."""
    registry = CollectorRegistry()
    shared = multiprocess_dir()
    latency = Histogram(
        "higgs_http_request_duration_seconds",
        "HTTP request latency by route template",
        ["method", "route", "status"],
        buckets=LATENCY_BUCKETS,
        registry=None if shared else registry,
    )
    if shared:
        multiprocess.MultiProcessCollector(registry, path=shared)  # type: ignore[no-untyped-call]
    registry.register(JobCollector(sessions, settings))
    return registry, latency


class LatencyMiddleware:
    """Times each HTTP request until its response has started (streams excluded on purpose:
    an SSE stream or a download would otherwise dominate the histogram)."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: dict[str, Any] = {"code": 500, "done": False}

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start" and not status["done"]:
                status["code"] = message["status"]
                status["done"] = True
                route = scope.get("route")
                template = getattr(route, "path", None) or "unmatched"
                method = scope["method"] if scope["method"] in KNOWN_METHODS else "other"
                self.histogram.labels(method, template, str(status["code"])).observe(
                    time.perf_counter() - start
                )
            await send(message)

        await self.app(scope, receive, wrapped)
