"""Dynamic HIGGS jobs in the worker: profile (or reuse it) -> allocate -> quantize.

    profiling   the model's sensitivity profile (alpha per layer), by the engine's
                get_profile with the job's progress callback (done/total = layers), so the
                job can be cancelled between layers; an interrupted profile resumes from the
                engine's cache file. Skipped when the profiles table (or the engine's cache
                directory) already has a complete profile for the same model revision,
                metric, calibration data and token budget.
    allocating  the exact DP allocator for the job's target (app.plans.planner's menu)
    quantizing  quantize_checkpoint with one override per layer (HiggsConfig.overrides)

The report gets each layer's alpha and the predicted metric change from the layers' measured
t^2 (higgs_engine.dynamic.annotate_report), including which KL -> perplexity conversion was
used, and `metrics.service.profile` says whether the profile was computed or reused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.plans.planner import DYNAMIC_TARGETS, grid_menu, menu_order
from app.plans.profiles import find_profiles, profile_payload, store_profile
from app.settings import Settings
from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.planning.profile import Profile, ProfileConfig, calibration_id
from higgs_engine.progress import ProgressCallback
from higgs_engine.report import Report
from worker.models import ModelSource

SessionFactory = sessionmaker[Session]


@dataclass(frozen=True)
class ProfileSettings:
    """How the worker measures profiles (from Settings, read once per worker process)."""

    cache_dir: Path
    metric: str = "kl"
    method: str = "noise"
    context: int = 512
    windows: int = 4
    seed: int = 0
    text_file: Path | None = None
    resolution: float = 1e-4

    @classmethod
    def from_settings(cls, settings: Settings) -> ProfileSettings:
        return cls(
            cache_dir=settings.profiles_path,
            metric=settings.profile_metric,
            method=settings.profile_method,
            context=settings.profile_context,
            windows=settings.profile_windows,
            seed=settings.profile_seed,
            text_file=settings.profile_text_file,
            resolution=settings.plan_resolution,
        )

    def engine_config(self) -> ProfileConfig:
        return ProfileConfig(
            metric=self.metric,
            method=self.method,
            context=self.context,
            windows=self.windows,
            seed=self.seed,
        )

    def text(self) -> str | None:
        if self.text_file is None:
            return None
        try:
            return self.text_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidConfigError(
                f"the profile calibration text {str(self.text_file)!r} cannot be read: {e}"
            ) from e


def is_dynamic(config: dict[str, Any]) -> bool:
    return any(k in DYNAMIC_TARGETS for k in (config.get("target") or {}))


def profile_revision(source: ModelSource) -> str:
    """What a profile is keyed by: the Hub commit sha, or a local checkpoint's fingerprint."""
    from higgs_engine.planning.profile import source_fingerprint

    return source.revision or source_fingerprint(source.path)


@dataclass(frozen=True)
class ProfileResult:
    profile: Profile
    reused: str | None  # "database", "cache_dir" or None (computed by this job)
    seconds: float


def _usable(
    data: dict[str, Any] | None, wanted: ProfileConfig, layers: list[str]
) -> Profile | None:
    if data is None:
        return None
    try:
        prof = Profile.from_dict(data)
    except (CorruptCheckpointError, TypeError, KeyError, ValueError):
        return None
    have = {la.name for la in prof.layers}
    if not prof.complete or prof.config != wanted.to_dict() or not set(layers) <= have:
        return None
    return prof


def obtain_profile(
    sessions: SessionFactory,
    source: ModelSource,
    requested_revision: str | None,
    ps: ProfileSettings,
    progress: ProgressCallback,
) -> ProfileResult:
    """The model's complete profile: from the profiles table, else from the engine's cache
    directory, else measured now (stage "profiling"), then recorded in the table."""
    from higgs_engine.checkpoint import quantizable_layers
    from higgs_engine.dynamic import get_profile

    t0 = time.perf_counter()
    pc = ps.engine_config()
    text = ps.text()
    calib = calibration_id(text, pc.seed)
    revision = profile_revision(source)
    # Every quantizable layer, whatever the job skips: one profile serves every job.
    layers = quantizable_layers(source.path, ())
    with sessions() as s:
        rows = find_profiles(
            s, source.id, revision, pc.metric, calibration=calib, token_budget=pc.tokens
        )
        for row in rows:
            prof = _usable(profile_payload(row), pc, layers)
            if prof is not None:
                return ProfileResult(prof, "database", time.perf_counter() - t0)

    computed = [False]

    def watch(stage: str, done: int, total: int) -> bool | None:
        if stage == "profiling":
            computed[0] = True
        return progress(stage, done, total)

    prof = get_profile(source.path, pc, text=text, cache_dir=ps.cache_dir, skip=(), progress=watch)
    with sessions() as s:
        store_profile(
            s,
            model_id=source.id,
            revision=revision,
            profile=prof.to_dict(),
            key=prof.key(),
            source={
                "id": source.id,
                "kind": source.kind,
                "revision": source.revision,
                "requested_revision": requested_revision,
            },
        )
    return ProfileResult(prof, None if computed[0] else "cache_dir", time.perf_counter() - t0)


def quantize_dynamic(
    sessions: SessionFactory,
    source: ModelSource,
    requested_revision: str | None,
    out: Path,
    engine_cfg: HiggsConfig,
    target: dict[str, float],
    menu_p: int | None,
    ps: ProfileSettings,
    progress: ProgressCallback,
    quantize: Callable[[Path, Path, HiggsConfig, ProgressCallback], Report],
) -> Report:
    """Profile -> allocate -> quantize (by `quantize`, the runner's call of the pipeline) ->
    the annotated report."""
    from higgs_engine.checkpoint import quantizable_layers
    from higgs_engine.planning.allocator import KEEP_16, Option
    from higgs_engine.planning.plans import (
        Target,
        annotate_report,
        config_with_allocation,
        plan_allocation,
        ppl_increase_from,
    )

    got = obtain_profile(sessions, source, requested_revision, ps, progress)
    prof = got.profile
    names = quantizable_layers(source.path, engine_cfg.skip)
    options = menu_order([Option(q, n) for q, n in grid_menu(menu_p)] + [Option(KEEP_16, 0)])
    t1 = time.perf_counter()
    plan = plan_allocation(
        prof,
        engine_cfg,
        Target(**target),
        names=names,
        options=options,
        resolution=ps.resolution,
        pareto_step=0.5,  # the job needs no curve; POST /v1/plans draws it
        progress=progress,
    )
    allocating_s = time.perf_counter() - t1
    report = quantize(
        source.path, out, config_with_allocation(engine_cfg, plan.allocation), progress
    )
    annotate_report(report, prof, plan.allocation)
    alloc = report.metrics["allocation"]
    alloc["predicted_ppl_increase"] = ppl_increase_from(prof.metric, plan.allocation.predicted)
    report.metrics["target"] = dict(target)
    report.metrics.setdefault("service", {})["profile"] = {
        "reused": got.reused,
        "seconds": round(got.seconds, 4),
        "revision": profile_revision(source),
    }
    report.timings["allocating"] = allocating_s
    if got.reused is None:
        report.timings["profiling"] = got.seconds
    return report


def cached_profile(
    sessions: SessionFactory, source: ModelSource, ps: ProfileSettings
) -> Profile | None:
    """The complete profile the table holds for this model (no measuring), or None."""
    pc = ps.engine_config()
    calib = calibration_id(ps.text(), pc.seed)
    with sessions() as s:
        rows = find_profiles(
            s,
            source.id,
            profile_revision(source),
            pc.metric,
            calibration=calib,
            token_budget=pc.tokens,
        )
        for row in rows:
            prof = _usable(profile_payload(row), pc, [])
            if prof is not None:
                return prof
    return None


def annotate_uniform(
    sessions: SessionFactory, source: ModelSource, ps: ProfileSettings, report: Report
) -> None:
    """A uniform job on a model with a cached profile also reports each layer's alpha and the
    predicted metric change from its measured t^2 (never measures a profile for it)."""
    from higgs_engine.planning.plans import annotate_report

    prof = cached_profile(sessions, source, ps)
    if prof is not None:
        annotate_report(report, prof)
