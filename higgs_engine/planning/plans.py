"""Dynamic HIGGS planning: targets, predictions from a profile, and per-layer allocations.

Targets:
- avg_bits b: the allocator's primal, average bits over the allocated layers (codes, fp16
  scales, grids and 16-bit layers all counted) at most b.
- max_ppl_increase r: the dual, the smallest allocation whose predicted relative perplexity
  increase is at most r. With a "ppl" profile the bound is r itself; with a "kl" profile it is
  converted with ppl_ratio ~= exp(KL), i.e. a KL bound of log(1 + r) (ppl increase ~= exp(KL) - 1);
  the report says which conversion was used.

No torch: the API plans from a stored profile with these functions; higgs_engine.dynamic runs
them between profiling and quantizing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.allocator import (
    FP16_BITS,
    Allocation,
    AllocLayer,
    DPTable,
    Option,
    ParetoPoint,
    build_problem,
    default_options,
    solve,
)
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.planning.profile import Profile, ProfileConfig
from higgs_engine.progress import ProgressCallback, report
from higgs_engine.report import Report

KL_TO_PPL = "ppl_increase = exp(KL) - 1 (perplexity ratio ~= exp of the KL from the base model)"


@dataclass(frozen=True)
class Target:
    """Exactly one of avg_bits / max_ppl_increase."""

    avg_bits: float | None = None
    max_ppl_increase: float | None = None

    def __post_init__(self) -> None:
        if (self.avg_bits is None) == (self.max_ppl_increase is None):
            raise InvalidConfigError("give exactly one of avg_bits and max_ppl_increase")
        if self.avg_bits is not None and (not math.isfinite(self.avg_bits) or self.avg_bits <= 0):
            raise InvalidConfigError(f"avg_bits={self.avg_bits} must be a positive number")
        if self.max_ppl_increase is not None and (
            not math.isfinite(self.max_ppl_increase) or self.max_ppl_increase < 0
        ):
            raise InvalidConfigError(
                f"max_ppl_increase={self.max_ppl_increase} must be a number >= 0"
            )

    def to_dict(self) -> dict[str, float]:
        return {
            k: v
            for k, v in (("avg_bits", self.avg_bits), ("max_ppl_increase", self.max_ppl_increase))
            if v is not None
        }


# ---------------------------------------------------------------------------------------------
# Metric conversions and predictions
# ---------------------------------------------------------------------------------------------


COS_NOTE = (
    "cos profile (a model without a causal LM head): predicted values are the mean 1 - cos of "
    "the mean-pooled final hidden state; there is no perplexity"
)


def ppl_increase_from(metric: str, predicted: float) -> float | None:
    """Predicted relative perplexity increase from a predicted change of the profile's metric
    (None for a "cos" profile: an encoder has no perplexity)."""
    if metric == "kl":
        return math.expm1(predicted)
    if metric == "cos":
        return None
    return predicted


def metric_bound_for_ppl(metric: str, max_ppl_increase: float) -> float:
    """The bound on the profile's metric that corresponds to a relative ppl increase."""
    if metric == "kl":
        return math.log1p(max_ppl_increase)
    if metric == "cos":
        raise InvalidConfigError(
            f"max_ppl_increase={max_ppl_increase} needs a kl or ppl profile; this profile "
            "measures 1 - cos of an encoder's embeddings (no perplexity): give avg_bits instead"
        )
    return max_ppl_increase


def conversion_note(metric: str) -> str:
    if metric == "cos":
        return COS_NOTE
    return (
        KL_TO_PPL
        if metric == "kl"
        else "ppl profile: predicted values are relative perplexity increases"
    )


def predict_change(profile: Profile, rel_errors: dict[str, float]) -> dict[str, Any]:
    """sum_l alpha_l * t_l^2 over the given layers' measured relative errors t_l^2.

    Layers without an alpha in the profile are listed under "unprofiled" and not counted.
    """
    alphas = profile.alphas()
    terms = [alphas[n] * t2 for n, t2 in rel_errors.items() if n in alphas]
    pred = math.fsum(terms)
    out: dict[str, Any] = {
        "metric": profile.metric,
        f"predicted_{profile.metric}": pred,
        "predicted_ppl_increase": ppl_increase_from(profile.metric, pred),
        "conversion": conversion_note(profile.metric),
        "profile_method": profile.method,
        "unprofiled": sorted(n for n in rel_errors if n not in alphas),
    }
    return out


def annotate_report(rep: Report, profile: Profile, allocation: Allocation | None = None) -> Report:
    """Add alphas and the predicted metric change (from the layers' measured t^2) to a report."""
    alphas = profile.alphas()
    for row in rep.layers:
        if row.name in alphas:
            row.alpha = alphas[row.name]
    pred = predict_change(profile, {row.name: row.rel_error for row in rep.layers})
    metrics = dict(rep.metrics)
    metrics.update(pred)
    metrics["profile"] = {
        "key": profile.key(),
        "method": profile.method,
        "metric": profile.metric,
        "calibration": profile.calibration,
        "tokens": ProfileConfig.from_dict(profile.config).tokens,
        "cost": profile.cost,
    }
    if allocation is not None:
        metrics["allocation"] = allocation_entry(profile.metric, allocation)
    rep.metrics = metrics
    return rep


def allocation_entry(metric: str, allocation: Allocation) -> dict[str, Any]:
    """The report's metrics["allocation"] of an allocation over a profile of `metric` (plain
    JSON data: a job plan carries it as it is)."""
    return {
        "avg_bits": allocation.avg_bits,
        f"predicted_{metric}_grid_mse": allocation.predicted,
        "predicted_ppl_increase": ppl_increase_from(metric, allocation.predicted),
        "histogram": allocation.histogram(),
        "layers": {n: o.label for n, o in zip(allocation.names, allocation.options, strict=True)},
    }


# ---------------------------------------------------------------------------------------------
# Allocation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    allocation: Allocation
    pareto: list[ParetoPoint]
    metric: str
    target: Target | None
    conversion: str

    def to_dict(self) -> dict[str, Any]:
        a = self.allocation
        return {
            "target": self.target.to_dict() if self.target else None,
            "metric": self.metric,
            "conversion": self.conversion,
            "allocation": {
                "avg_bits": a.avg_bits,
                f"predicted_{self.metric}": a.predicted,
                "predicted_ppl_increase": ppl_increase_from(self.metric, a.predicted),
                "histogram": a.histogram(),
                "layers": [
                    {"name": n, "p": o.p, "n": o.n, "option": o.label}
                    for n, o in zip(a.names, a.options, strict=True)
                ],
            },
            "pareto": [
                {
                    "avg_bits": p.avg_bits,
                    f"predicted_{self.metric}": p.predicted,
                    "predicted_ppl_increase": ppl_increase_from(self.metric, p.predicted),
                }
                for p in self.pareto
            ],
        }


def layer_specs_from_profile(
    profile: Profile, names: Sequence[str] | None = None
) -> list[AllocLayer]:
    """Allocator inputs from the profile (shape and alpha per layer); `names` must all be in it."""
    by_name = {la.name: la for la in profile.layers}
    wanted = list(names) if names is not None else [la.name for la in profile.layers]
    missing = [n for n in wanted if n not in by_name]
    if missing:
        raise InvalidConfigError(
            f"the profile has no alpha for layer(s) {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    return [
        AllocLayer(n, by_name[n].shape[0], by_name[n].shape[1], max(0.0, by_name[n].alpha))
        for n in wanted
    ]


def build_table(
    profile: Profile,
    config: HiggsConfig,
    *,
    names: Sequence[str] | None = None,
    options: Sequence[Option] | None = None,
    max_avg_bits: float | None = None,
    resolution: float = 1e-4,
) -> DPTable:
    """The DP table of the profile's layers under `config`'s group size and rotation block.

    Negative alphas (noise-level measurement noise on insensitive layers) are clipped to 0.
    """
    layers = layer_specs_from_profile(profile, names)
    problem = build_problem(
        layers,
        options if options is not None else default_options(),
        group_size=config.group_size,
        rotation_block=config.rotation_block,
        # kept layers are stored in the artifact's dtype
        keep_bits=32 if config.dtype == "float32" else FP16_BITS,
    )
    return solve(problem, max_avg_bits, resolution)


def plan_allocation(
    profile: Profile,
    config: HiggsConfig,
    target: Target | None,
    *,
    names: Sequence[str] | None = None,
    options: Sequence[Option] | None = None,
    resolution: float = 1e-4,
    pareto_step: float | None = 0.05,
    progress: ProgressCallback | None = None,
) -> Plan:
    """Allocation for `target` (None: the plan only, allocation at the largest budget) + Pareto curve."""
    report(progress, "allocating", 0, 1)
    table = build_table(profile, config, names=names, options=options, resolution=resolution)
    if target is None:
        alloc = table.allocate(table.problem.max_avg_bits())
    elif target.avg_bits is not None:
        alloc = table.allocate(target.avg_bits)
    else:
        assert target.max_ppl_increase is not None
        alloc = table.smallest_within(metric_bound_for_ppl(profile.metric, target.max_ppl_increase))
    pareto = table.pareto(pareto_step)
    report(progress, "allocating", 1, 1)
    return Plan(alloc, pareto, profile.metric, target, conversion_note(profile.metric))


def config_with_allocation(base: HiggsConfig, allocation: Allocation) -> HiggsConfig:
    """`base` with one override per allocated layer (the layer's grid, or p=0 for 16 bits)."""
    keep = [o for o in base.overrides if o.name not in set(allocation.names)]
    return replace(base, overrides=(*keep, *allocation.overrides()))
