"""HTTP for jobs: routes only translate between HTTP and app.jobs.service."""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from sqlalchemy import exc as sa_exc
from starlette.concurrency import run_in_threadpool

from app.artifacts.download import is_head
from app.db.models import TERMINAL, Job
from app.deps import CurrentKey, ReadsDep, SessionsDep, SettingsDep
from app.errors import UnauthorizedError
from app.jobs import repository, service, state
from app.jobs.hub_check import HubChecks
from app.jobs.local_models import Registry, stale_after_s
from app.jobs.schemas import JobCreate, JobOut, JobPage, LayerOut, LayersOut, Status
from app.keys.hub_token import HubTokens, HubTokenUnreadableError
from app.keys.service import KeyCache
from app.limits import StreamSlots
from app.openapi import AUTHENTICATED, problems
from app.params import JobId
from app.queue import enqueue_job

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

ONE_JOB = problems(*AUTHENTICATED, 404)


def json_model(
    model: BaseModel, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """`model` rendered as JSON here, for the hot routes (the route keeps response_model for
    the OpenAPI document). A sync route that returns the model itself has FastAPI validate it
    again against response_model, in a second threadpool hop per request."""
    return Response(
        model.model_dump_json(),
        status_code=status_code,
        media_type="application/json",
        headers=headers,
    )


@router.post(
    "",
    status_code=202,
    response_model=JobOut,
    responses=problems(*AUTHENTICATED, 400, 413, 422),
    summary="Submit a quantization job",
    description="202 with the job (also when an Idempotency-Key replays an earlier submit: "
    "then with `Idempotent-Replayed: true`); 429 when the key's rate limit or its quota of "
    "queued and running jobs is exceeded, or when it already has HIGGS_HUB_CHECK_PER_KEY Hub "
    "config checks running; 503 when the API process has HIGGS_HUB_CHECK_CONCURRENCY running "
    "(both with Retry-After).",
)
def submit_job(
    body: JobCreate,
    request: Request,
    sessions: SessionsDep,
    settings: SettingsDep,
    key: CurrentKey,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            description="1..255 printable ASCII characters without spaces",
            json_schema_extra={"pattern": r"^[\x21-\x7e]{1,255}$"},
        ),
    ] = None,
) -> Response:
    # The rate limit (CurrentKey) and the job quota before anything costly (a Hub read).
    idempotency = service.check_idempotency_key(idempotency_key)
    with sessions() as session:
        service.check_quota_first(session, key, idempotency, settings.max_active_jobs_per_key)
    registry = Registry(sessions, stale_after_s(settings))

    def hub_token() -> str | None:
        with sessions() as session:
            try:
                return HubTokens.from_settings(settings).for_key(session, key.id)
            except HubTokenUnreadableError:
                return None  # the worker says so, failing the job

    hub: HubChecks = request.app.state.hub_checks
    spec = service.validate_request(
        body, settings, registry, lambda model, rev: hub.architecture(key.id, model, rev, hub_token)
    )
    with sessions() as session:
        spec = service.with_calibration(session, key, body, spec)
        job, created = service.create_job(
            session,
            key,
            spec,
            idempotency,
            max_active=settings.max_active_jobs_per_key,
            disk_quota=settings.disk_quota_bytes_per_key,
        )
    headers = {"Location": service.job_url(job.id)}
    if created:
        # After commit: the row is the source of truth; if the broker is down the sweep
        # re-sends the job later (enqueued_at stays NULL).
        if enqueue_job(settings, job.id):
            with sessions() as session:
                state.mark_enqueued(session, job.id)
    else:
        headers["Idempotent-Replayed"] = "true"
    return json_model(service.job_view(job), 202, headers)


@router.get(
    "",
    response_model=JobPage,
    responses=problems(*AUTHENTICATED, 422),
    summary="List the caller's jobs",
)
def list_jobs(
    reads: ReadsDep,
    settings: SettingsDep,
    key: CurrentKey,
    status: Annotated[Status | None, Query(description="only jobs with this status")] = None,
    limit: Annotated[int, Query(ge=1, description="page size (at most HIGGS_PAGE_LIMIT_MAX)")] = 20,
    after: Annotated[
        str | None,
        Query(
            description="the `next` cursor of the previous page",
            max_length=512,
            pattern=r"^[A-Za-z0-9_\-]+$",
        ),
    ] = None,
) -> Response:
    rows, cursor = reads.run(
        lambda conn: service.list_jobs(
            conn,
            key,
            status=status,
            limit=limit,
            after=after,
            max_limit=settings.page_limit_max,
        )
    )
    return json_model(
        JobPage(data=[service.job_view(j) for j in rows], has_more=cursor is not None, next=cursor)
    )


@router.get("/{job_id}", response_model=JobOut, responses=ONE_JOB, summary="One job")
def get_job(job_id: JobId, reads: ReadsDep, key: CurrentKey) -> Response:
    return json_model(service.job_view(reads.run(lambda conn: service.read_job(conn, key, job_id))))


@router.post(
    "/{job_id}/cancel",
    response_model=JobOut,
    responses=problems(*AUTHENTICATED, 404, 409),
    summary="Cancel a job (409 once it has finished)",
)
def cancel_job(job_id: JobId, sessions: SessionsDep, key: CurrentKey) -> JobOut:
    with sessions() as session:
        job = service.cancel_job(session, key, job_id)
    return service.job_view(job)


@router.get(
    "/{job_id}/layers", response_model=LayersOut, responses=ONE_JOB, summary="Per-layer results"
)
def get_job_layers(job_id: JobId, sessions: SessionsDep, key: CurrentKey) -> LayersOut:
    with sessions() as session:
        rows = service.job_layers(session, key, job_id)
    return LayersOut(
        job_id=job_id,
        data=[
            LayerOut(
                name=r.name,
                shape=list(r.shape),
                p=r.p,
                n=r.n,
                bits=r.bits,
                alpha=r.alpha,
                rel_error=r.rel_error,
                bytes=r.bytes,
                type=r.type,
            )
            for r in rows
        ],
    )


@router.get(
    "/{job_id}/report",
    responses={
        **problems(*AUTHENTICATED, 404, 409),
        200: {
            "description": "report.json",
            "content": {"application/json": {"schema": {"type": "object"}}},
        },
    },
    summary="The full report.json of a succeeded job (409 before it succeeded)",
)
def get_job_report(job_id: JobId, sessions: SessionsDep, key: CurrentKey) -> JSONResponse:
    with sessions() as session:
        report = service.job_report(session, key, job_id)
    return JSONResponse(report)


def _snapshot(job: Job) -> dict[str, Any]:
    view = service.job_view(job)
    return {
        "id": view.id,
        "status": view.status,
        "stage": view.stage,
        "progress": view.progress.model_dump(),
        "cancel_requested": view.cancel_requested,
        "error": view.error.model_dump() if view.error else None,
        "summary": view.summary,
    }


def _sse(event: str, data: dict[str, Any], event_id: int) -> bytes:
    return f"id: {event_id}\nevent: {event}\ndata: {json.dumps(data, default=str)}\n\n".encode()


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={
        **ONE_JOB,
        200: {
            "description": "an event stream: `state` and `progress` events whose data is a "
            "JSON snapshot of the job",
            "content": {
                "text/event-stream": {
                    "schema": {
                        "type": "object",
                        "required": ["data"],
                        "properties": {
                            "event": {"type": "string", "enum": ["state", "progress"]},
                            "id": {"type": "string"},
                            "data": {"type": "string"},
                        },
                    }
                }
            },
        },
    },
    summary="Server-Sent Events: `state` on status changes, `progress` on stage/progress changes",
    description="429 with Retry-After when the key already has HIGGS_MAX_EVENT_STREAMS_PER_KEY "
    "streams open on this API process.",
)
def stream_job_events(
    job_id: JobId, request: Request, sessions: SessionsDep, settings: SettingsDep, key: CurrentKey
) -> Response:
    with sessions() as session:
        service.get_job(session, key, job_id)  # 404 before the stream starts
    if is_head(request.scope):
        return Response(status_code=200, media_type="text/event-stream")
    key_id = key.id
    token: str = request.state.api_token
    keys: KeyCache = request.app.state.key_cache
    slots: StreamSlots = request.app.state.event_streams
    slot = slots.open(key_id)  # 429 past HIGGS_MAX_EVENT_STREAMS_PER_KEY

    def load() -> dict[str, Any] | bool | None:
        """The job's snapshot (one short session); None once the key is revoked or the job
        is gone; False when the database did not answer (the stream skips that poll)."""
        try:
            keys.check(token)
            with sessions() as s:
                job = repository.get_owned(s, key_id, job_id)
                return _snapshot(job) if job is not None else None
        except UnauthorizedError:
            return None
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError):
            return False

    async def stream() -> AsyncIterator[bytes]:
        # Polls the job row: the database is the source of truth and works across processes.
        # No connection is held between polls (nor while a chunk is being sent).
        try:
            async for chunk in events():
                yield chunk
        finally:
            slot.close()

    async def events() -> AsyncIterator[bytes]:
        last: dict[str, Any] | None = None
        event_id = 0
        deadline = time.monotonic() + settings.events_max_duration_s
        last_sent = time.monotonic()
        yield b"retry: 2000\n\n"
        while time.monotonic() < deadline:
            if await request.is_disconnected():  # the client left: stop polling for it
                return
            snap = await run_in_threadpool(load)
            if snap is None:
                return
            if not isinstance(snap, dict):  # the database did not answer: next poll
                await asyncio.sleep(settings.events_poll_interval_s)
                continue
            if last is None or snap["status"] != last["status"]:
                event_id += 1
                yield _sse("state", snap, event_id)
                last_sent = time.monotonic()
            elif (snap["stage"], snap["progress"]) != (last["stage"], last["progress"]):
                event_id += 1
                yield _sse("progress", snap, event_id)
                last_sent = time.monotonic()
            last = snap
            if snap["status"] in TERMINAL:
                return
            if time.monotonic() - last_sent > 15:
                yield b": keep-alive\n\n"
                last_sent = time.monotonic()
            await asyncio.sleep(settings.events_poll_interval_s)

    body = stream()
    # A stream that never starts (the client left first) never runs its finally block: the
    # slot is closed when the generator is collected then.
    weakref.finalize(body, slot.close)
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
