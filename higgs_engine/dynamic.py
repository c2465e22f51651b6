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

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.errors import InvalidConfigError, ProfileNotFoundError
from higgs_engine.planning.allocator import Option
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.planning.plans import (
    Plan,
    Target,
    annotate_report,
    config_with_allocation,
    plan_allocation,
)
from higgs_engine.planning.profile import (
    Profile,
    ProfileConfig,
    calibration_id,
    profile_key,
    source_fingerprint,
)
from higgs_engine.profile import compute_profile
from higgs_engine.progress import ProgressCallback
from higgs_engine.report import Report

if TYPE_CHECKING:
    import torch
    from torch import nn

    from higgs_engine.calibration import Calibration

DEFAULT_PROFILE = ProfileConfig()
DEFAULT_CONFIG = HiggsConfig()


# ---------------------------------------------------------------------------------------------
# Profiles of a checkpoint, cached
# ---------------------------------------------------------------------------------------------


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
