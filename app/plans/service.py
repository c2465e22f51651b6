"""POST /v1/plans rules. The planner itself arrives with dynamic HIGGS: `make_plan` is the
seam it fills (pure Python over the cached profile's data; the API never imports torch)."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import Profile
from app.errors import NotFoundError, NotSupportedError, ValidationFailedError
from app.jobs.model_ref import ModelRefError, resolve_model
from app.jobs.schemas import ModelRef, Strict, Target
from app.settings import Settings


class PlanCreate(Strict):
    model: ModelRef
    target: Target
    metric: str | None = Field(
        default=None, description="profile metric (default: the newest profile's)"
    )


class ProfileNotFound(NotFoundError):
    code, title = "no_profile", "No profile for this model"


def find_profile(
    session: Session, model_id: str, revision: str | None, metric: str | None
) -> Profile | None:
    stmt = select(Profile).where(Profile.model_id == model_id)
    if revision is not None:
        stmt = stmt.where(Profile.revision == revision)
    if metric is not None:
        stmt = stmt.where(Profile.metric == metric)
    return session.scalar(stmt.order_by(Profile.created_at.desc(), Profile.id.desc()).limit(1))


def make_plan(profile: Profile, target: Target) -> dict[str, Any]:
    """Curve + per-layer allocation for `target` from `profile.data`. Filled in by dynamic
    HIGGS; until then it says so plainly rather than inventing figures."""
    raise NotSupportedError.field(
        f"target.{target.kind}",
        "planning from a profile is not available yet: it arrives with dynamic HIGGS",
    )


def plan(session: Session, settings: Settings, req: PlanCreate) -> dict[str, Any]:
    try:
        resolve_model(req.model.id, req.model.revision, settings.models_dir)
    except ModelRefError as e:
        raise ValidationFailedError.field(e.field, str(e)) from e
    profile = find_profile(session, req.model.id, req.model.revision, req.metric)
    if profile is None:
        raise ProfileNotFound(
            f"no profile exists yet for model {req.model.id!r}"
            + (f" at revision {req.model.revision!r}" if req.model.revision else "")
            + "; submit a job with a dynamic target (avg_bits or max_ppl_increase) to create one"
        )
    return make_plan(profile, req.target)
