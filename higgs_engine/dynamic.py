"""Dynamic HIGGS's stages before the quantization (higgs_engine.job.run runs them for a job
with a target, then quantizes with the plan's config):

    profile     the model's sensitivity profile (alpha per layer): found in one of the caller's
                stores (a cache directory, a file, the service's table), else measured here
                (stage "profiling", resumable) and saved to every store
    allocate    the exact allocator for the target over the option menu (stage "allocating";
                higgs_engine.planning.plans, torch-free)

`plan_dynamic` does both; `obtain_profile` the first alone; `annotate_dynamic`
adds to the quantization's report each layer's choice and alpha, the predicted metric change
and the conversion used.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.errors import InvalidConfigError, ProfileNotFoundError
from higgs_engine.model_loading import load_float_model
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
    DEFAULT_PROFILE,
    Profile,
    ProfileConfig,
    ProfileDirectory,
    ProfileFile,
    ProfileRequest,
    ProfileStore,
    calibration_id,
    find_profile,
    resolve_profile_config,
    resume_path,
)
from higgs_engine.profile import ProfileRun, compute_profile
from higgs_engine.progress import ProgressCallback
from higgs_engine.report import Report

if TYPE_CHECKING:
    import torch
    from torch import nn

    from higgs_engine.sources import ResolvedModel


DEFAULT_CONFIG = HiggsConfig()
# A job needs the allocation, not the curve (POST /v1/plans and `higgs plan` draw that).
_JOB_PARETO_STEP = 0.5


# ---------------------------------------------------------------------------------------------
# Profiles of a checkpoint
# ---------------------------------------------------------------------------------------------


def calibration_windows(
    model: nn.Module,
    tokenizer: Any,
    text: str | None,
    config: ProfileConfig,
    *,
    revision: str | None = None,
    cache_dir: Path | None = None,
    progress: ProgressCallback | None = None,
) -> torch.Tensor:
    """(windows, context) token ids: the text's first windows; without a text, the data-free
    source of `config`: text the model generates itself (cached in `cache_dir` per `revision`)
    or seeded random tokens.

    An encoder's windows (config.metric "cos") are framed as its tokenizer frames a sequence:
    CLS, context - 2 tokens of text (or random tokens), SEP. An encoder cannot generate text
    (`resolve_profile_config` turns data_free "self" into "random" for it)."""
    from higgs_engine.evaluate import text_windows, tokenize
    from higgs_engine.model_structure import max_positions, model_kind
    from higgs_engine.profile import random_windows

    mcfg: Any = model.config
    config = resolve_profile_config(config, model_kind(mcfg), max_positions(mcfg))
    if config.metric == "cos":
        return encoder_windows(model, tokenizer, text, config)

    if text is None and config.data_free == "self":
        from higgs_engine.selfgen import SelfGenConfig, cached_self_tokens

        sg = SelfGenConfig(count=config.windows, length=config.context, seed=config.seed)
        return cached_self_tokens(
            model, tokenizer, revision or "unversioned", cache_dir, sg, progress=progress
        )
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


def _special_id(tokenizer: Any, names: Sequence[str]) -> int | None:
    for name in names:
        v = getattr(tokenizer, name, None) if tokenizer is not None else None
        if isinstance(v, int) and v >= 0:
            return v
    return None


def encoder_windows(
    model: nn.Module, tokenizer: Any, text: str | None, config: ProfileConfig
) -> torch.Tensor:
    """(windows, context) ids for an encoder: [CLS] + context - 2 tokens + [SEP] (CLS / SEP from
    the tokenizer, else its BOS / EOS; a window is left unframed where there is neither).
    Without a text the inner tokens are seeded uniform random ids (data-free); data_free
    "self" is an error here, since an encoder cannot generate text."""
    import torch

    from higgs_engine.evaluate import text_windows, tokenize
    from higgs_engine.profile import frame_windows, random_windows

    first = _special_id(tokenizer, ("cls_token_id", "bos_token_id"))
    last = _special_id(tokenizer, ("sep_token_id", "eos_token_id"))
    if text is None:
        if config.data_free == "self":
            raise InvalidConfigError(
                "data_free='self' needs a model that generates text; an encoder cannot "
                "(profile it with data_free='random' or a calibration text)"
            )
        cfg: Any = model.config
        return frame_windows(random_windows(int(cfg.vocab_size), config), first, last)
    if tokenizer is None:
        raise InvalidConfigError(
            "the checkpoint has no tokenizer; profile it with random tokens instead"
        )
    inner = config.context - (first is not None) - (last is not None)
    if inner < 1:
        raise InvalidConfigError(
            f"context={config.context} leaves no room for text between CLS and SEP"
        )
    wins = text_windows(tokenize(tokenizer, text), inner, config.windows)
    if wins.shape[0] < config.windows:
        raise InvalidConfigError(
            f"the calibration text has only {wins.shape[0]} windows of {inner} tokens; "
            f"{config.windows} were asked for"
        )
    n = int(wins.shape[0])
    cols = [wins]
    if first is not None:
        cols.insert(0, torch.full((n, 1), first, dtype=wins.dtype))
    if last is not None:
        cols.append(torch.full((n, 1), last, dtype=wins.dtype))
    return torch.cat(cols, dim=1)


def profile_config_for(model: ResolvedModel, config: ProfileConfig) -> ProfileConfig:
    """`config` resolved for `model` (metric auto -> kl or cos, an encoder's data-free source
    and context; planning.profile.resolve_profile_config)."""
    return resolve_profile_config(config, model.model_kind, model.max_positions)


def profile_stores(cache_dir: Path | None = None, out: Path | None = None) -> list[ProfileStore]:
    """The file stores of the CLI: `out` first (a profile there is used as it is), then the
    cache directory (which also keeps a partial profile while it is measured)."""
    stores: list[ProfileStore] = []
    if out is not None:
        stores.append(ProfileFile(Path(out)))
    if cache_dir is not None:
        stores.append(ProfileDirectory(Path(cache_dir)))
    return stores


@dataclass(frozen=True)
class ProfileResult:
    profile: Profile
    reused: str | None  # the name of the store it came from; None when measured now
    seconds: float  # all of obtain_profile, generating included
    generating_s: float = 0.0  # of which sampling self-generated text (0 when none ran)


def _mark_embeddings(prof: Profile, emb_names: Sequence[str]) -> None:
    """Record which of the profile's layers are the embedding / untied head."""
    have = {la.name for la in prof.layers}
    prof.embeddings = [n for n in emb_names if n in have]


@dataclass(frozen=True)
class ProfileSource:
    """Where a job's sensitivity profile comes from: `profile` as given (no lookup), else
    found in the first of `stores` that has one for `config` on `text` (None: data-free) and
    otherwise measured and saved to every store (self-generated text cached in
    `selfgen_cache`). `skip`: the layers not profiled (None: those the job's config skips;
    (): every layer, so that one profile serves every job). `menu` / `resolution`: the
    allocator's options (None: every shipped grid and 16-bit) and step (HIGGS targets)."""

    profile: Profile | None = None
    config: ProfileConfig = DEFAULT_PROFILE
    text: str | None = None
    stores: tuple[ProfileStore, ...] = ()
    selfgen_cache: Path | None = None
    skip: tuple[str, ...] | None = None
    menu: tuple[Option, ...] | None = None
    resolution: float = 1e-4


def obtain_profile(
    model: ResolvedModel,
    how: ProfileSource,
    layers: Sequence[str],
    progress: ProgressCallback | None = None,
    device: str | None = None,
    compute: bool = True,
) -> ProfileResult:
    """The profile of `model`'s `layers` for how.config on how.text (None = data-free);
    `layers` may name the token embedding and an untied output head too (what GGUF files
    and scope "all" quantize).

    The first of how.stores holding one the request accepts wins; otherwise it is measured
    (resuming a partial one kept by the stores) and saved to every store. compute=False raises
    ProfileNotFoundError instead of measuring. `device` (None: the CPU; "auto", "cuda[:N]")
    is where the model generates its text and runs the Fisher passes: the quantization's
    device, so a GPU job does not profile on the CPU.
    """
    t0 = time.perf_counter()
    emb_names = [s.name for s in model.embeddings]
    config = profile_config_for(model, how.config)
    request = ProfileRequest(
        model=model.profile_id,
        revision=model.profile_revision,
        calibration=calibration_id(how.text, config.seed, config.data_free),
        config=config,
        layers=tuple(layers),
    )
    found = find_profile(how.stores, request)
    if found is not None:
        _mark_embeddings(found[0], emb_names)
        return ProfileResult(found[0], found[1].name, time.perf_counter() - t0)
    if not compute:
        raise ProfileNotFoundError(
            f"no cached profile for {model.id!r} (key {request.key}); compute one first"
        )
    net, tok = load_float_model(model)
    if device is not None:
        from higgs_engine.device import resolve_device

        net.to(resolve_device(device))
    t_gen = time.perf_counter()
    windows = calibration_windows(
        net,
        tok,
        how.text,
        config,
        revision=request.revision,
        cache_dir=how.selfgen_cache,
        progress=progress,
    )
    generating_s = time.perf_counter() - t_gen
    prof = compute_profile(
        net,
        ProfileRun(request, resume_path(how.stores, request), progress),
        windows.to(next(net.parameters()).device),
    )
    _mark_embeddings(prof, emb_names)
    for store in how.stores:
        store.save(prof, request)
    return ProfileResult(prof, None, time.perf_counter() - t0, generating_s)


# ---------------------------------------------------------------------------------------------
# Profile -> plan -> quantize
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DynamicPlan:
    """A dynamic target's profile and allocation, and the config that quantizes with it."""

    profile: ProfileResult
    plan: Plan
    config: HiggsConfig
    allocating_s: float


def allocated_layers(model: ResolvedModel, config: HiggsConfig) -> list[str]:
    """The layers the allocator chooses a grid for: the quantizable linear layers less
    `config.skip`, and with scope "all" the token embedding and an untied output head too (not
    skipped either), so that the budget counts every quantized parameter."""
    from higgs_engine.model_structure import is_skipped

    names = model.layer_names(config.skip)
    if config.scope == "all":
        emb = [s.name for s in model.embeddings]
        names += [n for n in emb if n not in names and not is_skipped(n, config.skip)]
    return names


def plan_dynamic(
    model: ResolvedModel,
    target: Target,
    base: HiggsConfig = DEFAULT_CONFIG,
    how: ProfileSource = ProfileSource(),
    progress: ProgressCallback | None = None,
    device: str | None = None,
) -> DynamicPlan:
    """Profile -> allocate: a dynamic job's stages before the quantization (a single-worker
    stage; the quantization with the plan's config may then run part by part anywhere).

    The profile comes as `how` says (ProfileSource: given, else found in its stores or
    measured on `device` and saved): the layers `base` quantizes, or those how.skip leaves
    (() = every layer, so that one profile serves every job), with the token embedding and an
    untied head when base.scope is "all" (allocated like any layer). how.menu is the
    allocator's option menu (default: planning.options.option_menu(), every shipped grid and
    16-bit)."""
    if how.profile is not None:
        got = ProfileResult(how.profile, "given", 0.0)
    else:
        skip = base.skip if how.skip is None else how.skip
        layers = model.layer_names(skip, embeddings=base.scope == "all")
        got = obtain_profile(model, how, layers, progress, device)
    names = allocated_layers(model, base)
    t1 = time.perf_counter()
    plan = plan_allocation(
        got.profile,
        base,
        target,
        names=names,
        options=how.menu,
        resolution=how.resolution,
        pareto_step=_JOB_PARETO_STEP,
        progress=progress,
    )
    allocating_s = time.perf_counter() - t1
    return DynamicPlan(got, plan, config_with_allocation(base, plan.allocation), allocating_s)


def annotate_dynamic(rep: Report, planned: DynamicPlan, target: Target) -> Report:
    """What a dynamic job adds to the quantization's report: alphas and predicted change, the
    allocation, the target, and the profiling / allocating seconds."""
    annotate_report(rep, planned.profile.profile, planned.plan.allocation)
    rep.metrics["target"] = target.to_dict()
    rep.timings["allocating"] = planned.allocating_s
    if planned.profile.reused is None:
        # profiling: the Fisher passes (and loading, resolving); generating: the text they ran on
        rep.timings["profiling"] = planned.profile.seconds - planned.profile.generating_s
        if planned.profile.generating_s:
            rep.timings["generating"] = planned.profile.generating_s
    return rep
