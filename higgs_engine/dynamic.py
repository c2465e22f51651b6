"""Dynamic HIGGS end to end: profile (cached) -> allocate for a target -> HiggsConfig overrides
-> quantize_checkpoint -> report with each layer's choice, alpha and the predicted change.

Targets:
- avg_bits b: the allocator's primal, average bits over the allocated layers (codes, fp16
  scales, grids and 16-bit layers all counted) at most b.
- max_ppl_increase r: the dual, the smallest allocation whose predicted relative perplexity
  increase is at most r. With a "ppl" profile the bound is r itself; with a "kl" profile it is
  converted with ppl_ratio ~= exp(KL), i.e. a KL bound of log(1 + r) (ppl increase ~= exp(KL) - 1);
  the report says which conversion was used.

A service runner calls `run_dynamic` (or the three steps `get_profile`, `plan_allocation`,
`quantize_with_allocation`) with one progress callback; stages "profiling" and "allocating"
come before the pipeline's own.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.allocator import (
    _FP16_BITS,
    Allocation,
    DPTable,
    LayerSpec,
    Option,
    ParetoPoint,
    build_problem,
    default_options,
    solve,
)
from higgs_engine.config import HiggsConfig
from higgs_engine.errors import InvalidConfigError, ProfileNotFoundError
from higgs_engine.profile import (
    Profile,
    ProfileConfig,
    calibration_id,
    compute_profile,
    profile_key,
)
from higgs_engine.progress import ProgressCallback, report
from higgs_engine.report import Report

if TYPE_CHECKING:
    import torch
    from torch import nn

    from higgs_engine.calibration import Calibration

DEFAULT_PROFILE = ProfileConfig()
DEFAULT_CONFIG = HiggsConfig()
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


def ppl_increase_from(metric: str, predicted: float) -> float:
    """Predicted relative perplexity increase from a predicted change of the profile's metric."""
    if metric == "kl":
        return math.expm1(predicted)
    return predicted


def metric_bound_for_ppl(metric: str, max_ppl_increase: float) -> float:
    """The bound on the profile's metric that corresponds to a relative ppl increase."""
    if metric == "kl":
        return math.log1p(max_ppl_increase)
    return max_ppl_increase


def conversion_note(metric: str) -> str:
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
        metrics["allocation"] = {
            "avg_bits": allocation.avg_bits,
            f"predicted_{profile.metric}_grid_mse": allocation.predicted,
            "histogram": allocation.histogram(),
            "layers": {
                n: o.label for n, o in zip(allocation.names, allocation.options, strict=True)
            },
        }
    rep.metrics = metrics
    return rep


# ---------------------------------------------------------------------------------------------
# Profiles of a checkpoint, cached
# ---------------------------------------------------------------------------------------------


def source_fingerprint(path: Path) -> str:
    """A cheap content fingerprint of a local checkpoint: config + safetensors headers, sizes
    and 16 sampled 64 KiB chunks of each weight file (full hashing of a 7B model takes minutes)."""
    h = hashlib.sha256()
    cfg = path / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + str(size).encode())
        with f.open("rb") as fh:
            head = fh.read(8)
            h.update(head)
            if len(head) == 8:
                h.update(fh.read(min(int.from_bytes(head, "little"), 1 << 24)))
            for k in range(16):
                fh.seek(size * k // 16)
                h.update(fh.read(1 << 16))
    return "local:" + h.hexdigest()[:32]


def load_float_model(path: Path) -> tuple[nn.Module, Any]:
    """The checkpoint in float32 on CPU (the profile perturbs it in place), and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        tok = None
    return model, tok


def calibration_windows(
    model: nn.Module, tokenizer: Any, text: str | None, config: ProfileConfig
) -> torch.Tensor:
    """(windows, context) token ids: the text's first windows, or seeded random tokens."""
    from higgs_engine.evaluate import text_windows, tokenize
    from higgs_engine.profile import random_windows

    if text is None:
        cfg: Any = model.config
        vocab = int(cfg.vocab_size)
        return random_windows(vocab, config)
    if tokenizer is None:
        raise InvalidConfigError(
            "the checkpoint has no tokenizer; profile it with random tokens instead"
        )
    wins = text_windows(tokenize(tokenizer, text), config.context, config.windows)
    if wins.shape[0] < config.windows:
        raise InvalidConfigError(
            f"the calibration text has only {wins.shape[0]} windows of {config.context} tokens; "
            f"{config.windows} were asked for"
        )
    return wins


def profile_cache_path(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / f"profile-{key}.json"


def get_profile(
    source: str | Path,
    config: ProfileConfig = DEFAULT_PROFILE,
    *,
    text: str | None = None,
    cache_dir: Path | None = None,
    out: Path | None = None,
    skip: Sequence[str] = (),
    revision: str | None = None,
    token: str | None = None,
    compute: bool = True,
    progress: ProgressCallback | None = None,
) -> Profile:
    """The profile of `source` for `config` on `text` (None = random tokens, data-free).

    Reused from `cache_dir` when a complete one with the same key is there; otherwise computed
    (resuming a partial one) and written to the cache and to `out`. compute=False raises
    ProfileNotFoundError instead of computing.
    """
    from higgs_engine.checkpoint import quantizable_layers, resolve_source

    src = resolve_source(source, revision, token)
    rev = src.revision or source_fingerprint(src.path)
    calib = calibration_id(text, config.seed)
    key = profile_key(src.id, rev, calib, config)
    cached = profile_cache_path(cache_dir, key) if cache_dir is not None else None
    for path in (cached, out):
        if path is not None and path.is_file():
            try:
                prof = Profile.load(path)
            except Exception:  # a broken file is recomputed, never trusted
                continue
            if prof.complete and prof.key() == key:
                if out is not None and path != out:
                    prof.save(out)
                return prof
    if not compute:
        raise ProfileNotFoundError(
            f"no cached profile for {src.id!r} (key {key}); compute one first"
        )
    names = quantizable_layers(src.path, skip)
    model, tok = load_float_model(src.path)
    windows = calibration_windows(model, tok, text, config)
    partial = cached if cached is not None else out
    prof = compute_profile(
        model,
        names,
        windows,
        config,
        model_id=src.id,
        revision=rev,
        calibration=calib,
        partial_path=partial,
        progress=progress,
    )
    if out is not None and out != partial:
        prof.save(out)
    return prof


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
) -> list[LayerSpec]:
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
        LayerSpec(n, by_name[n].shape[0], by_name[n].shape[1], max(0.0, by_name[n].alpha))
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
        keep_bits=32 if config.dtype == "float32" else _FP16_BITS,
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


def quantize_with_allocation(
    source: str | Path,
    out_dir: Path,
    base: HiggsConfig,
    profile: Profile,
    plan: Plan,
    *,
    progress: ProgressCallback | None = None,
    revision: str | None = None,
    token: str | None = None,
    overwrite: bool = False,
    device: str | None = None,
    calibration: Calibration | None = None,
) -> Report:
    """quantize_checkpoint with the plan's overrides; report.json gets alphas and predictions.
    With `calibration`, calibrated HIGGS (GPTQ with each layer's allocated grid)."""
    from higgs_engine.pipeline import quantize_checkpoint

    cfg = config_with_allocation(base, plan.allocation)
    rep = quantize_checkpoint(
        source,
        out_dir,
        cfg,
        progress,
        revision=revision,
        token=token,
        overwrite=overwrite,
        device=device,
        calibration=calibration,
    )
    annotate_report(rep, profile, plan.allocation)
    rep.metrics["target"] = plan.target.to_dict() if plan.target else None
    rep.save(Path(out_dir) / "report.json")
    return rep


def run_dynamic(
    source: str | Path,
    out_dir: Path,
    target: Target,
    base: HiggsConfig = DEFAULT_CONFIG,
    *,
    profile: Profile | None = None,
    profile_config: ProfileConfig = DEFAULT_PROFILE,
    text: str | None = None,
    cache_dir: Path | None = None,
    options: Sequence[Option] | None = None,
    progress: ProgressCallback | None = None,
    revision: str | None = None,
    token: str | None = None,
    overwrite: bool = False,
    device: str | None = None,
) -> Report:
    """Profile (cached) -> allocate -> quantize -> annotated report. The service's entry point.

    `options` is the allocator's menu (default: every shipped grid and 16-bit)."""
    from higgs_engine.checkpoint import quantizable_layers, resolve_source

    if profile is None:
        profile = get_profile(
            source,
            profile_config,
            text=text,
            cache_dir=cache_dir,
            skip=base.skip,
            revision=revision,
            token=token,
            progress=progress,
        )
    src = resolve_source(source, revision, token)
    names = quantizable_layers(src.path, base.skip)
    plan = plan_allocation(profile, base, target, names=names, options=options, progress=progress)
    return quantize_with_allocation(
        source,
        out_dir,
        base,
        profile,
        plan,
        progress=progress,
        revision=revision,
        token=token,
        overwrite=overwrite,
        device=device,
    )
