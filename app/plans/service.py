"""POST /v1/plans: the predicted quality-versus-size curve and the per-layer allocation for a
target, from the model's cached profile, without quantizing (docs/api.md "Plans")."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from sqlalchemy.orm import Session, sessionmaker

from app.db.models import Profile
from app.errors import NotFoundError, ValidationFailedError
from app.jobs.local_models import Registry, stale_after_s
from app.jobs.model_ref import ModelRefError, resolve_model
from app.jobs.schemas import GridDim, GroupSize, ModelRef, RotationBlock, Strict, TargetRequest
from app.jobs.service import config_error_field
from app.plans.planner import DYNAMIC_TARGETS, check_dynamic_target, check_grid_dim, compute_plan
from app.plans.profiles import find_profiles, profile_payload
from app.settings import Settings
from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.config import HiggsConfig


class PlanOptions(Strict):
    """The parts of a job's options that change sizes (and so the plan)."""

    p: GridDim | None = Field(default=None, description="restrict the menu to grids of this p")
    group_size: GroupSize = Field(
        default=256, description="weights per scale: a power of two in 2..4096"
    )
    rotation_block: RotationBlock = Field(
        default=1024, description="Hadamard block: a power of two in 64..4096"
    )
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    scope: Literal["linear", "all"] = Field(
        default="linear",
        description="linear: the linear layers (the default); all: the token embedding and "
        "an untied head too, when the model's profile has them",
    )


class PlanCreate(Strict):
    model: ModelRef
    target: TargetRequest | None = Field(
        default=None, description="avg_bits or max_ppl_increase; omitted: the curve only"
    )
    metric: Literal["kl", "ppl", "cos"] | None = Field(
        default=None, description="profile metric (default: the newest profile's)"
    )
    options: PlanOptions = Field(default_factory=PlanOptions)


class ProfileNotFound(NotFoundError):
    code, title = "no_profile", "No profile for this model"


def find_profile(
    session: Session, model_id: str, revision: str | None, metric: str | None
) -> Profile | None:
    rows = find_profiles(session, model_id, revision, metric)
    return rows[0] if rows else None


def _check(req: PlanCreate, settings: Settings) -> None:
    opts = req.options
    check_grid_dim(opts.p)
    # The same rules as a job's options (HiggsConfig), so a plan and a job refuse alike.
    try:
        HiggsConfig(
            p=opts.p if opts.p is not None else 2,
            group_size=opts.group_size,
            rotation_block=opts.rotation_block,
            dtype=opts.dtype,
        )
    except InvalidConfigError as e:
        kind = req.target.kind if req.target is not None else "avg_bits"
        raise ValidationFailedError.field(config_error_field(e, kind), str(e)) from e
    t = req.target
    if t is None:
        return
    if t.kind not in DYNAMIC_TARGETS:
        raise ValidationFailedError.field(
            f"target.{t.kind}",
            f"plans are for dynamic targets (avg_bits or max_ppl_increase), not target.{t.kind}",
        )
    check_dynamic_target(
        t.kind,
        t.value,
        group_size=opts.group_size,
        p=opts.p,
        n=None,
        ppl_limit=settings.max_ppl_increase_limit,
    )


def plan(sessions: sessionmaker[Session], settings: Settings, req: PlanCreate) -> dict[str, Any]:
    try:
        resolve_model(
            req.model.id,
            req.model.revision,
            settings.models_dir,
            Registry(sessions, stale_after_s(settings)),
        )
    except ModelRefError as e:
        raise ValidationFailedError.field(e.field, str(e)) from e
    _check(req, settings)
    with sessions() as session:  # closed before the (CPU-bound) plan is computed
        row = find_profile(session, req.model.id, req.model.revision, req.metric)
        data = profile_payload(row) if row is not None else None
    if row is None:
        raise ProfileNotFound(
            f"no profile exists yet for model {req.model.id!r}"
            + (f" at revision {req.model.revision!r}" if req.model.revision else "")
            + (f" with metric {req.metric!r}" if req.metric else "")
            + "; submit a job with a dynamic target (avg_bits or max_ppl_increase) to create one"
        )
    if data is None:  # pragma: no cover - find_profiles returns usable rows only
        raise ProfileNotFound(f"the profile of {req.model.id!r} is not usable")
    target = {req.target.kind: req.target.value} if req.target else None
    opts = req.options
    base = HiggsConfig(
        group_size=opts.group_size,
        rotation_block=opts.rotation_block,
        dtype=opts.dtype,
        scope=opts.scope,
    )
    result = compute_plan(data, target, base, p=opts.p, resolution=settings.plan_resolution)
    cfg = data["config"]
    return {
        "model": {"id": req.model.id, "revision": row.revision},
        "profile": {
            "id": row.id,
            "metric": row.metric,
            "method": cfg.get("method"),
            "calibration": data.get("calibration"),
            "tokens": row.token_budget,
            "layers": len(data.get("layers", [])),
            "embedding_layers": list(data.get("embeddings", [])),
            "created_at": row.created_at.isoformat(),
            "cost": data.get("cost"),
        },
        **result,
    }
