"""Dynamic HIGGS rules of the API: up-front checks of the avg_bits / max_ppl_increase targets,
and plans computed from a cached profile.

Pure Python up to `compute_plan`, which runs the engine's allocator (higgs_engine.planning:
numpy, never torch, checked by tests/app/test_import_rules.py). The worker's jobs allocate
with the same menu (higgs_engine.planning.options.option_menu), base config and resolution, so
a plan shows exactly what a job with that target would get.
"""

from __future__ import annotations

import math
from typing import Any

from app.errors import ValidationFailedError
from higgs_engine.errors import InfeasibleTargetError
from higgs_engine.planning.config import SUPPORTED_GRIDS, HiggsConfig, code_bits
from higgs_engine.planning.options import option_menu

DYNAMIC_TARGETS = ("avg_bits", "max_ppl_increase")
# Every layer in 16 bits: a budget at or above it buys nothing more.
AVG_BITS_CEILING = 16.0
_SCALE_BITS = 16  # one fp16 scale per group


def avg_bits_floor(group_size: int, p: int | None = None) -> float:
    """A lower bound on any feasible avg_bits: the cheapest grid's code bits plus one fp16
    scale per group. (The exact floor depends on the model's shapes and the grids' storage;
    the worker's allocator checks it and fails the job with infeasible_target below it.)"""
    cheapest = min(code_bits(o.p, o.n) for o in option_menu(p) if not o.keep)
    return cheapest + _SCALE_BITS / group_size


def check_grid_dim(p: int | None) -> None:
    """options.p of a job or a plan: the one check (422 naming options.p)."""
    if p is not None and p not in SUPPORTED_GRIDS:
        raise ValidationFailedError.field(
            "options.p", f"options.p={p} is not supported; choose one of {sorted(SUPPORTED_GRIDS)}"
        )


def check_dynamic_target(
    kind: str, value: float, *, group_size: int, p: int | None, n: int | None, ppl_limit: float
) -> None:
    """ValidationFailedError (422 naming the field) unless the target can be planned (`p` is
    checked by check_grid_dim first)."""
    field = f"target.{kind}"
    if not math.isfinite(value):
        raise ValidationFailedError.field(field, f"{field}={value} must be a finite number")
    if group_size < 1:
        raise ValidationFailedError.field(
            "options.group_size", f"options.group_size={group_size} must be positive"
        )
    if n is not None:
        raise ValidationFailedError.field(
            "options.n",
            f"options.n={n} fixes one grid for every layer; a dynamic target ({field}) chooses "
            "the grid per layer (options.p may restrict the menu to one grid dimension)",
        )
    if kind == "avg_bits":
        lo = avg_bits_floor(group_size, p)
        if lo > AVG_BITS_CEILING:
            raise ValidationFailedError.field(
                "options.group_size",
                f"options.group_size={group_size} leaves no feasible {field}: one fp16 scale "
                f"per {group_size} weights plus the cheapest grid is {lo:.4g} bits per weight, "
                f"above {AVG_BITS_CEILING:g} (every layer kept in 16 bits); use a larger "
                "group_size",
            )
        if not lo <= value <= AVG_BITS_CEILING:
            raise ValidationFailedError.field(
                field,
                f"{field}={value:g} is outside the feasible range [{lo:.4g}, {AVG_BITS_CEILING:g}] "
                f"bits per weight (cheapest grid plus its fp16 scales at group_size={group_size}, "
                "up to every layer kept in 16 bits)",
            )
    elif kind == "max_ppl_increase":
        if not 0 < value <= ppl_limit:
            raise ValidationFailedError.field(
                field,
                f"{field}={value:g} must be a relative perplexity increase in (0, {ppl_limit:g}] "
                "(0.05 = +5%)",
            )
    else:  # pragma: no cover - callers pass dynamic kinds only
        raise ValueError(f"{kind!r} is not a dynamic target")


def compute_plan(
    profile_data: dict[str, Any],
    target: dict[str, float] | None,
    base: HiggsConfig | None = None,
    *,
    p: int | None = None,
    resolution: float = 1e-4,
    pareto_step: float = 0.05,
) -> dict[str, Any]:
    """The Pareto curve and (with a target) the per-layer allocation, from a stored profile,
    for the job config `base` (its group size, rotation block, dtype and scope; None: the
    defaults) over the grids of dimension `p` (None: both): over the profile's linear layers
    (scope "linear"), or over the embedding and head too when the profile has them (scope
    "all", as a job with options.scope "all" allocates).

    Raises ValidationFailedError naming target.<kind> when the target is infeasible for this
    model, HiggsError when the profile cannot be used."""
    from higgs_engine.planning.plans import Target, plan_allocation
    from higgs_engine.planning.profile import Profile

    profile = Profile.from_dict(profile_data)
    base = base or HiggsConfig()
    every = base.scope == "all"
    names = [la.name for la in profile.layers] if every else profile.linear_layers()
    eng_target = Target(**target) if target else None
    try:
        plan = plan_allocation(
            profile,
            base,
            eng_target,
            names=names,
            options=option_menu(p),
            resolution=resolution,
            pareto_step=pareto_step,
        )
    except InfeasibleTargetError as e:
        kind = next(iter(target)) if target else "avg_bits"
        raise ValidationFailedError.field(f"target.{kind}", str(e)) from e
    out = plan.to_dict()
    if eng_target is None:
        out["allocation"] = None
    return out


__all__ = [
    "AVG_BITS_CEILING",
    "DYNAMIC_TARGETS",
    "avg_bits_floor",
    "check_dynamic_target",
    "check_grid_dim",
    "compute_plan",
]
