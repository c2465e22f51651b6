"""HTTP for plans."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.deps import CurrentKey, SessionsDep, SettingsDep
from app.openapi import AUTHENTICATED, problems
from app.plans import service
from app.plans.service import PlanCreate

router = APIRouter(prefix="/v1/plans", tags=["plans"])


@router.post(
    "",
    responses={
        **problems(*AUTHENTICATED, 400, 404, 413, 422),
        200: {
            "description": "the plan",
            "content": {"application/json": {"schema": {"type": "object"}}},
        },
    },
    summary="Predicted quality-vs-size curve from a cached profile",
)
def create_plan(
    body: PlanCreate, sessions: SessionsDep, settings: SettingsDep, key: CurrentKey
) -> dict[str, Any]:
    return service.plan(sessions, settings, body)
