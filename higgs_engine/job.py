"""The engine's one entry point: a QuantizeJob says what to quantize and how, run(job, out)
does it. The CLI and the worker build a job and call run(); nothing else of theirs quantizes.

    uniform    (no target) the pipeline's uniform stage (higgs_engine.pipeline) with
               job.config; with a given profile (ProfileSource.profile) the report also gets
               each layer's alpha and the predicted metric change
    dynamic    (job.target) plan_dynamic: the profile (given, found in the stores or measured,
               stage "profiling") and the exact allocation (stage "allocating"); then the
               uniform stage with the plan's config, one grid per layer; the report gets
               annotate_dynamic's entries (alphas, predicted change, allocation, target, seconds)
    gguf       (job.gguf) a llama.cpp GGUF file (higgs_engine.gguf.run), with job.target or
               the options' bits / ftype

Whatever the kind, report.json is written once: the run's report, the dynamic annotations and
the caller's job.annotate (given the staged output directory, its artifacts complete) are all
in it when it is written into the staged directory, which is then renamed to `out`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from higgs_engine.dynamic import ProfileSource
from higgs_engine.planning.config import HiggsConfig, check_method_job
from higgs_engine.planning.plans import Target, annotate_report
from higgs_engine.planning.profile import Profile
from higgs_engine.progress import ProgressCallback
from higgs_engine.report import Report

if TYPE_CHECKING:
    from higgs_engine.calibration import Calibration
    from higgs_engine.dynamic import DynamicPlan
    from higgs_engine.gguf.runplan import GgufEvalRequest, GgufPlan

__all__ = ["Annotate", "GgufOptions", "ProfileSource", "QuantizeJob", "gguf_plan", "run"]

# What a caller adds to the report, given the staged output directory, before report.json.
Annotate = Callable[[Report, Path], None]


@dataclass(frozen=True)
class GgufOptions:
    """A GGUF job (higgs_engine.gguf.run): one of `bits` / `ftype`, or the job's target;
    `rotate` "off" / "on" / "auto"; `evaluate` in llama.cpp; `split_max_bytes` (None: the
    default, planning.gguf_types.DEFAULT_SPLIT_GIB GiB); `threads` measuring, quantizing and evaluating
    (0: every core)."""

    bits: float | None = None
    ftype: str | None = None
    rotate: str = "off"
    evaluate: GgufEvalRequest | None = None
    split_max_bytes: int | None = None
    threads: int = 0


@dataclass(frozen=True)
class QuantizeJob:
    """One quantization: `source` (local directory or Hub id at `revision`) with `config`,
    uniform (target None) or allocated per layer for `target`; calibrated HIGGS with
    `calibration`; on `device` (None: the CPU). `gguf`: a GGUF file instead of HIGGS
    artifacts (`config` then unused). `annotate`: the caller's additions to the report, run
    before report.json is written; `on_plan`: told the dynamic plan (profile and where it came
    from, allocation) once made, before the quantization."""

    source: str | Path
    config: HiggsConfig = field(default_factory=HiggsConfig)
    target: Target | None = None
    calibration: Calibration | None = None
    profile: ProfileSource = field(default_factory=ProfileSource)
    device: str | None = None
    revision: str | None = None
    token: str | None = None
    overwrite: bool = False
    gguf: GgufOptions | None = None
    annotate: Annotate | None = None
    on_plan: Callable[[DynamicPlan], None] | None = None


def run(job: QuantizeJob, out: Path, progress: ProgressCallback | None = None) -> Report:
    """Run `job` into `out` (atomic: nothing is left there on error or cancellation; an
    existing non-empty `out` only with job.overwrite) and return its Report, the one written
    as out/report.json."""
    out = Path(out)
    gguf, dynamic = job.gguf is not None, job.target is not None
    calibrated = job.calibration is not None
    check_method_job(job.config.method, calibrated=calibrated, dynamic=dynamic, gguf=gguf)
    if job.gguf is not None:
        from higgs_engine.gguf.run import GgufContext, run_gguf_plan

        ctx = GgufContext(job.profile, job.token, job.annotate, job.overwrite)
        return run_gguf_plan(gguf_plan(job, progress), out, progress, ctx)
    from higgs_engine.pipeline import quantize_checkpoint

    hooks: list[Annotate] = []
    config = job.config
    if job.target is not None:
        from higgs_engine.dynamic import plan_dynamic

        planned = plan_dynamic(
            job.source,
            job.target,
            job.config,
            job.profile,
            progress=progress,
            revision=job.revision,
            token=job.token,
            device=job.device,
        )
        if job.on_plan is not None:
            job.on_plan(planned)
        config = planned.config
        hooks.append(_dynamic_annotations(planned, job.target))
    elif job.profile.profile is not None:
        hooks.append(_profile_annotations(job.profile.profile))
    if job.annotate is not None:
        hooks.append(job.annotate)
    return quantize_checkpoint(
        job.source,
        out,
        config,
        progress,
        revision=job.revision,
        token=job.token,
        overwrite=job.overwrite,
        device=job.device,
        calibration=job.calibration,
        annotate=_chain(hooks),
    )


def gguf_plan(job: QuantizeJob, progress: ProgressCallback | None = None) -> GgufPlan:
    """The GgufPlan of a GGUF job: its options validated first (InvalidConfigError naming the
    bad option), then the source resolved (stage "resolving") and planned; run() runs it."""
    from higgs_engine.errors import InvalidConfigError
    from higgs_engine.gguf.runplan import (
        GgufCompute,
        GgufGoal,
        GgufLayout,
        GgufRotation,
        plan_gguf,
    )
    from higgs_engine.progress import report
    from higgs_engine.sources import resolve_source

    if job.gguf is None:
        raise InvalidConfigError(f"the job for {str(job.source)!r} asks for no GGUF file")
    g = job.gguf
    goal = GgufGoal(g.bits, g.ftype, job.target)
    rotation = GgufRotation(g.rotate)
    layout = (
        GgufLayout() if g.split_max_bytes is None else GgufLayout(split_max_bytes=g.split_max_bytes)
    )
    compute = GgufCompute(job.device, g.threads)
    report(progress, "resolving", 0, 1)
    src = resolve_source(job.source, job.revision, job.token)
    planned = plan_gguf(src, goal, rotation, layout, compute, job.profile.config, g.evaluate)
    report(progress, "resolving", 1, 1)
    return planned


def _dynamic_annotations(planned: DynamicPlan, target: Target) -> Annotate:
    from higgs_engine.dynamic import annotate_dynamic

    def annotate(rep: Report, _staged: Path) -> None:
        annotate_dynamic(rep, planned, target)

    return annotate


def _profile_annotations(profile: Profile) -> Annotate:
    def annotate(rep: Report, _staged: Path) -> None:
        annotate_report(rep, profile)

    return annotate


def _chain(hooks: list[Annotate]) -> Annotate | None:
    if not hooks:
        return None

    def annotate(rep: Report, staged: Path) -> None:
        for hook in hooks:
            hook(rep, staged)

    return annotate
