"""HTTP for calibration uploads: the body is the text itself (text/plain, UTF-8)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from app.calibrations import service
from app.deps import CurrentKey, SessionsDep, SettingsDep
from app.errors import PROBLEM_JSON
from app.params import CalibrationId

router = APIRouter(prefix="/v1/calibrations", tags=["calibrations"])

PROBLEM = {"content": {PROBLEM_JSON: {}}, "description": "problem+json (RFC 9457)"}
# The body is read raw (request.stream()), so FastAPI does not document it: say what check_text
# accepts. No NUL byte, and at least one letter or digit (an all-whitespace text is empty).
UPLOAD_BODY = {
    "required": True,
    "content": {
        "text/plain": {
            "schema": {
                "type": "string",
                "minLength": 1,
                "pattern": "^[^\\u0000]*[A-Za-z0-9][^\\u0000]*$",
            }
        }
    },
}


@router.post(
    "",
    status_code=201,
    responses={401: PROBLEM, 413: PROBLEM, 422: PROBLEM, 429: PROBLEM},
    summary="Upload calibration text (the body, UTF-8) for calibrated HIGGS jobs",
    openapi_extra={"requestBody": UPLOAD_BODY},
)
async def upload(
    request: Request,
    response: Response,
    sessions: SessionsDep,
    settings: SettingsDep,
    key: CurrentKey,
) -> dict[str, Any]:
    # The body is spooled as it arrives (413 once past the limit) and the database work runs
    # in the threadpool: a slow client or a slow database never holds the event loop.
    received = await service.receive(request.stream(), settings.calibration_max_bytes)

    def store() -> dict[str, Any]:
        with sessions() as session:
            return service.view(service.create(session, key, received, settings))

    try:
        out = await run_in_threadpool(store)
    finally:
        received.file.close()
    response.headers["Location"] = f"/v1/calibrations/{out['id']}"
    return out


@router.get("", responses={401: PROBLEM}, summary="The caller's calibration uploads")
def list_uploads(sessions: SessionsDep, key: CurrentKey) -> dict[str, Any]:
    with sessions() as session:
        return {"data": [service.view(r) for r in service.list_for(session, key)]}


@router.get("/{calibration_id}", responses={401: PROBLEM, 404: PROBLEM}, summary="One upload")
def get_upload(
    calibration_id: CalibrationId, sessions: SessionsDep, key: CurrentKey
) -> dict[str, Any]:
    with sessions() as session:
        return service.view(service.get(session, key, calibration_id))
