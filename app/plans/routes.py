"""HTTP for plans."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.deps import CurrentKey, SessionsDep, SettingsDep
from app.jobs.routes import ERRORS
from app.plans import service
from app.plans.service import PlanCreate

router = APIRouter(prefix="/v1/plans", tags=["plans"])


@router.post("", responses=ERRORS, summary="Predicted quality-vs-size curve from a cached profile")
def create_plan(
    body: PlanCreate, sessions: SessionsDep, settings: SettingsDep, key: CurrentKey
) -> dict[str, Any]:
    return service.plan(sessions, settings, body)
