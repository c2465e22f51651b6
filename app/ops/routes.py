"""/healthz (process alive), /readyz (database and broker reachable), /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from app.deps import SessionsDep, SettingsDep
from app.errors import PROBLEM_JSON, ServiceUnavailableError
from app.queue import check_broker

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="The process is alive")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Database and broker reachable (503 otherwise)",
    responses={503: {"content": {PROBLEM_JSON: {}}}},
)
def readyz(sessions: SessionsDep, settings: SettingsDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        with sessions() as s:
            s.execute(text("SELECT 1")).scalar_one()
            # Migrated? The alembic_version table exists only after `alembic upgrade`.
            s.execute(text("SELECT version_num FROM alembic_version")).all()
        checks["database"] = "ok"
    except Exception as e:
        checks["database"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        check_broker(settings)
        checks["broker"] = "ok"
    except Exception as e:
        checks["broker"] = (
            f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        )
    if all(v == "ok" for v in checks.values()):
        return JSONResponse({"status": "ready", "checks": checks})
    bad = ", ".join(f"{k} ({v})" for k, v in checks.items() if v != "ok")
    err = ServiceUnavailableError(f"not ready: {bad}")
    body = {**err.problem("/readyz"), "checks": checks}
    return JSONResponse(body, status_code=503, media_type=PROBLEM_JSON)


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    registry = request.app.state.metrics_registry
    # Collectors query the database and the broker: keep that off the event loop.
    payload = await run_in_threadpool(generate_latest, registry)
    return PlainTextResponse(payload.decode(), media_type=CONTENT_TYPE_LATEST)
