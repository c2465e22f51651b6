"""/healthz (process alive), /readyz (database, broker and artifact store reachable), /metrics (behind its own
key, HIGGS_METRICS_KEY)."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from app.artifacts.store import store_from_settings
from app.deps import SettingsDep
from app.errors import PROBLEM_JSON, NotFoundError, ServiceUnavailableError, UnauthorizedError
from app.ops.readiness import Readiness
from app.queue import check_broker
from app.settings import Settings

log = logging.getLogger(__name__)
router = APIRouter(tags=["operations"])


def readiness_checks(
    sessions: sessionmaker[Session], settings: Settings
) -> dict[str, Callable[[], None]]:
    """What /readyz checks: each raises when its dependency is not usable."""

    def database() -> None:
        with sessions() as s:
            s.execute(text("SELECT 1")).scalar_one()
            # Migrated? The alembic_version table exists only after `alembic upgrade`.
            s.execute(text("SELECT version_num FROM alembic_version")).all()

    def broker() -> None:
        check_broker(settings)

    def store() -> None:
        store_from_settings(settings).check()

    return {"database": database, "broker": broker, "store": store}


@router.get("/healthz", summary="The process is alive")
async def healthz() -> dict[str, str]:
    # async: no I/O, so no threadpool hop (this is also the service benchmark's ceiling).
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Database, broker and artifact store reachable (503 otherwise)",
    responses={
        200: {
            "description": "ready",
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "required": ["status", "checks"],
                        "properties": {
                            "status": {"type": "string", "enum": ["ready"]},
                            "checks": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                            },
                        },
                    }
                }
            },
        },
        503: {"description": "not ready"},
    },
)
def readyz(request: Request, settings: SettingsDep) -> JSONResponse:
    # The public answer says which dependency failed, never how (the log has the detail). The
    # checks run in the background with a deadline (app.ops.readiness): a dependency that
    # hangs is unavailable after HIGGS_READYZ_TIMEOUT_S, not a request that never returns.
    readiness: Readiness = request.app.state.readiness
    checks = readiness.results()
    if all(v == "ok" for v in checks.values()):
        return JSONResponse({"status": "ready", "checks": checks})
    bad = ", ".join(k for k, v in checks.items() if v != "ok")
    err = ServiceUnavailableError(
        f"not ready: {bad} unavailable", retry_after=settings.unavailable_retry_after_s
    )
    body = {**err.problem("/readyz"), "checks": checks}
    return JSONResponse(
        body,
        status_code=503,
        media_type=PROBLEM_JSON,
        headers={"Retry-After": str(err.retry_after)},
    )


@router.get(
    "/metrics",
    summary="Prometheus metrics (Authorization: Bearer <HIGGS_METRICS_KEY>)",
    response_class=PlainTextResponse,
    include_in_schema=False,
)
async def metrics(request: Request, settings: SettingsDep) -> PlainTextResponse:
    if not settings.metrics_key:
        raise NotFoundError("metrics are switched off on this service (HIGGS_METRICS_KEY unset)")
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), settings.metrics_key.encode()
    ):
        raise UnauthorizedError("/metrics needs 'Authorization: Bearer <HIGGS_METRICS_KEY>'")
    registry = request.app.state.metrics_registry
    # Collectors query the database and the broker: keep that off the event loop.
    payload = await run_in_threadpool(generate_latest, registry)
    return PlainTextResponse(payload.decode(), media_type=CONTENT_TYPE_LATEST)
