"""The FastAPI application factory: `uvicorn --factory app.main:create_app`.

Errors of every kind (app.errors.AppError, request validation, unknown routes) are rendered as
RFC 9457 problem+json here and nowhere else.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.admission import FairAdmissionMiddleware
from app.artifacts.routes import router as artifacts_router
from app.calibrations.routes import router as calibrations_router
from app.db.session import (
    Reads,
    create_db_engine,
    normalise_url,
    ping_when_idle,
    session_factory,
)
from app.deadline import RequestDeadlineMiddleware
from app.errors import (
    PROBLEM_JSON,
    AppError,
    DatabaseUnavailableError,
    MalformedBodyError,
    PayloadTooLargeError,
    RangeNotSatisfiableError,
    ServiceUnavailableError,
    TooManyRequestsError,
    UnauthorizedError,
    ValidationFailedError,
)
from app.front_door import AuthFirstMiddleware, ForwardedForMiddleware
from app.jobs.hub_check import HubCheckLimits, HubChecks
from app.jobs.routes import router as jobs_router
from app.keys.routes import router as keys_router
from app.keys.service import KeyCache
from app.limits import RateLimiter, StreamSlots, rate_limiter
from app.openapi import install_openapi, operation_name
from app.ops.metrics import LatencyMiddleware, build_registry
from app.ops.readiness import Readiness
from app.ops.routes import readiness_checks
from app.ops.routes import router as ops_router
from app.params import NO_CONTROL_CHARS, NO_CONTROL_CHARS_MESSAGE
from app.plans.routes import router as plans_router
from app.proxies import TrustedProxies
from app.settings import Settings, get_settings
from app.ui import install as install_ui
from app.webhooks.routes import router as webhooks_router

log = logging.getLogger(__name__)

_STATUS_TITLES = {404: "Not found", 405: "Method not allowed", 400: "Bad request"}
_SOURCES = ("body", "query", "path", "header", "cookie")
# A refused value is quoted in the message up to this many characters.
MAX_ECHO_CHARS = 100


def problem_response(err: AppError, instance: str | None) -> JSONResponse:
    headers: dict[str, str] = {}
    if isinstance(err, RangeNotSatisfiableError):
        headers["Content-Range"] = f"bytes */{err.size}"
    if isinstance(err, UnauthorizedError):
        headers["WWW-Authenticate"] = 'Bearer realm="higgs"'
    if isinstance(err, TooManyRequestsError | ServiceUnavailableError):
        headers["Retry-After"] = str(err.retry_after)
    return JSONResponse(
        err.problem(instance), status_code=err.status, media_type=PROBLEM_JSON, headers=headers
    )


def _field(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in _SOURCES:
        if len(parts) == 1:
            return parts[0]
        parts = parts[1:]
    return ".".join(parts)


def _message(err: dict[str, Any]) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") == NO_CONTROL_CHARS:
        return NO_CONTROL_CHARS_MESSAGE
    msg = str(err.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    inp = err.get("input")
    if (
        kind != "missing"
        and isinstance(inp, str | int | float | bool)
        and not isinstance(inp, bytes)
    ):
        got = repr(inp)
        msg += f" (got {got if len(got) <= MAX_ECHO_CHARS else got[:MAX_ECHO_CHARS] + '...'})"
    return msg


def validation_problem(exc: RequestValidationError) -> AppError:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        e = next(e for e in errors if e.get("type") == "json_invalid")
        where = e.get("ctx", {}).get("error", "")
        return MalformedBodyError(f"the request body is not valid JSON: {where}".rstrip(": "))
    fields = [{"field": _field(e.get("loc", ())), "message": _message(e)} for e in errors]
    detail = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    return ValidationFailedError(detail, errors=fields)


class BodyLimitMiddleware:
    """413 problem+json for bodies above max_bytes, checked on Content-Length and on the bytes
    actually received (chunked uploads), before the app parses anything."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # Paths with their own limit (calibration uploads), exact match: Content-Length is
        # checked here, the bytes received by the route itself (it streams the body).
        self.path_limits = dict(path_limits or {})

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        limit = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        err = PayloadTooLargeError(
            f"request body of {size} bytes is above the limit of {limit} bytes"
        )
        await problem_response(err, scope.get("path"))(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit:
                    await self._too_large(scope, receive, send, str(declared))
                    return
        if scope.get("path", "") in self.path_limits:
            # A streamed upload: its route reads the body chunk by chunk and enforces the
            # limit itself, so the body is never held here.
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            body.extend(message.get("body", b""))
            if len(body) > limit:
                await self._too_large(scope, receive, send, f"more than {limit}")
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class OutageLog:
    """One warning line (no traceback) per `every_s` seconds for a repeated outage, with the
    count of the answers it stands for, instead of a traceback per request."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last = float("-inf")
        self._suppressed = 0
        self._lock = threading.Lock()

    def warn(self, message: str) -> bool:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                self._suppressed += 1
                return False
            more, self._suppressed, self._last = self._suppressed, 0, now
        self.logger.warning(
            "%s%s", message, f" ({more} more such answers since the last line)" if more else ""
        )
        return True


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(app: Any, path: str) -> list[str]:
    """Every method some route answers on `path` (HEAD wherever GET is, OPTIONS with any),
    found by asking the app's routes to match each method."""
    routes = getattr(app, "routes", None) or []
    methods = set()
    for method in ("GET", "POST", "PUT", "PATCH", "DELETE"):
        probe = {"type": "http", "method": method, "path": path, "root_path": ""}
        if any(route.matches(probe)[0] == Match.FULL for route in routes):
            methods.add(method)
    if "GET" in methods:
        methods.add("HEAD")
    if methods:
        methods.add("OPTIONS")
    return [m for m in _METHODS if m in methods]


class HeadOptionsMiddleware:
    """HEAD is answered like GET without the body, on every GET route; OPTIONS answers 204
    with Allow listing every method of the path (404 problem+json routing applies otherwise)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        allowed = allowed_methods(scope.get("app"), scope["path"])
        if scope["method"] == "OPTIONS" and allowed:
            await send(
                {
                    "type": "http.response.start",
                    "status": 204,
                    "headers": [(b"allow", ", ".join(allowed).encode())],
                }
            )
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if scope["method"] != "HEAD" or "GET" not in allowed:
            await self.app(scope, receive, send)
            return
        finished = False

        async def headers_only(message: Message) -> None:
            nonlocal finished
            if message["type"] == "http.response.body":
                if finished:
                    return
                finished = True
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET", "higgs.head": True}, receive, headers_only)


def _install_error_handlers(app: FastAPI) -> None:
    outage = OutageLog(log)

    @app.exception_handler(sa_exc.OperationalError)
    @app.exception_handler(sa_exc.InterfaceError)
    @app.exception_handler(sa_exc.TimeoutError)
    async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
        settings: Settings = request.app.state.settings
        outage.warn(f"database unavailable, answering 503: {_first_line(exc)}")
        err = DatabaseUnavailableError(
            "the database is unavailable; retry later",
            retry_after=settings.unavailable_retry_after_s,
        )
        return problem_response(err, request.url.path)

    @app.exception_handler(AppError)
    async def app_error(request: Request, exc: AppError) -> JSONResponse:
        if exc.status >= 500:
            log.error("%s: %s", exc.code, exc.detail)
        return problem_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return problem_response(validation_problem(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = AppError(str(exc.detail))
        err.status = exc.status_code
        err.title = _STATUS_TITLES.get(exc.status_code, "HTTP error")
        err.code = err.title.lower().replace(" ", "_")
        resp = problem_response(err, request.url.path)
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        if exc.status_code == 405:
            resp.headers["Allow"] = ", ".join(allowed_methods(request.app, request.url.path))
        return resp

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        err = AppError("an unexpected error occurred; it has been logged")
        err.status, err.code, err.title = 500, "internal_error", "Internal server error"
        return problem_response(err, request.url.path)


_frozen = threading.Event()


def freeze_startup_objects() -> None:
    """Everything built at start-up (routes, models, SQLAlchemy metadata) lives as long as the
    process: frozen out of the cyclic garbage collector, the collections that request garbage
    triggers no longer walk it (in benchmarks/service_bench.py: more GET job throughput and a
    shorter p99 tail under load). Once per process: an API process builds one app; a process
    that builds many (the tests) keeps only the first start-up's objects frozen."""
    if not _frozen.is_set():
        _frozen.set()
        gc.collect()
        gc.freeze()


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the API for `settings` (default: from the environment). The database must have
    been migrated (`alembic upgrade head`, app.db.migrate.upgrade_database)."""
    settings = settings or get_settings()
    settings.ensure_dirs()
    pool: dict[str, Any] = {}
    if make_url(normalise_url(settings.database_url)).get_backend_name() != "sqlite":
        pool = {
            "pool_size": settings.db_pool_size,
            "max_overflow": settings.db_max_overflow,
            "pool_timeout": settings.db_pool_timeout_s,
            "pool_pre_ping": False,  # ping_when_idle below
        }
    engine = create_db_engine(
        settings.database_url,
        connect_timeout_s=settings.db_connect_timeout_s,
        statement_timeout_s=settings.db_statement_timeout_s,
        **pool,
    )
    if pool:
        ping_when_idle(engine)
    sessions = session_factory(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        freeze_startup_objects()
        # The process's threadpool (run_in_threadpool, sync routes and dependencies).
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.threadpool_size
        yield
        engine.dispose()

    app = FastAPI(
        title="HIGGS quantization service",
        version="1.0.0",
        description="Submit HIGGS quantization jobs, follow them, download the artifacts. "
        "Errors are RFC 9457 problem+json.",
        lifespan=lifespan,
        generate_unique_id_function=operation_name,
        # /docs is served by app.ui from vendored files (FastAPI's pages load theirs from a
        # CDN); there is no /redoc.
        docs_url=None,
        redoc_url=None,
    )
    install_openapi(app, settings)
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = sessions
    app.state.reads = Reads(engine)
    app.state.key_cache = KeyCache(sessions, settings.auth_cache_ttl_s)
    app.state.readiness = Readiness(
        readiness_checks(sessions, settings),
        timeout_s=settings.readyz_timeout_s,
        cache_s=settings.readyz_cache_s,
    )
    app.state.rate_limiter = rate_limiter(settings)
    app.state.auth_failures = RateLimiter(
        settings.auth_failures_per_s, settings.auth_failures_burst
    )
    app.state.event_streams = StreamSlots(settings.max_event_streams_per_key)
    app.state.hub_checks = HubChecks(HubCheckLimits.of(settings))
    registry, latency = build_registry(sessions, settings)
    app.state.metrics_registry = registry

    _install_error_handlers(app)
    app.include_router(jobs_router)
    app.include_router(calibrations_router)
    app.include_router(artifacts_router)
    app.include_router(plans_router)
    app.include_router(ops_router)
    app.include_router(webhooks_router)
    app.include_router(keys_router)
    install_ui(app)
    # Outermost last: latency sees everything, the body limit runs before routing, and the
    # fair queue sits right in front of the routes (a request waits its turn there, its body
    # already read or read without holding a place).
    app.add_middleware(FairAdmissionMiddleware, most=settings.api_concurrency)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        path_limits={"/v1/calibrations": settings.calibration_max_bytes},
    )
    # The key before the body, and the body within its deadline (app.front_door).
    app.add_middleware(AuthFirstMiddleware, body_timeout_s=settings.body_timeout_s)
    app.add_middleware(HeadOptionsMiddleware)
    # Inside the latency histogram, which then records the 503 of a request past its deadline.
    app.add_middleware(
        RequestDeadlineMiddleware,
        timeout_s=settings.request_timeout_s,
        retry_after_s=settings.unavailable_retry_after_s,
        warn=OutageLog(log).warn,
    )
    # The client's address before anything uses it.
    app.add_middleware(ForwardedForMiddleware, trusted=TrustedProxies(settings.forwarded_allow_ips))
    app.add_middleware(LatencyMiddleware, histogram=latency)
    return app
