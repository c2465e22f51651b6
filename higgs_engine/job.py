"""The engine's entry point: a QuantizeJob says what to quantize and how; `plan(job)` turns it
into a JobPlan, data that says everything the run will do; `run_part` quantizes one part of a
plan and `assemble` writes the artifacts from the parts; `run(job, out)` is all of it on one
machine. The CLI and the worker reach the engine's orchestration only through these.

    resolve    the model, once per run (higgs_engine.sources.resolve_model: where it is, its
               config, its layers); every later stage is handed the ResolvedModel
    plan       uniform (no target): job.config; with a given profile the report also gets
               each layer's alpha and the predicted metric change. dynamic (job.target):
               plan_dynamic, the profile (given, found in the stores or measured, stage
               "profiling") and the exact allocation (stage "allocating"), whose per-layer
               grids are the plan's config; gguf (job.gguf): a llama.cpp GGUF file
               (higgs_engine.gguf.run), with job.target or the options' bits / ftype;
               compressed-tensors (job.ct): one vLLM scheme per linear layer, as data
               (higgs_engine.ct.run), uniform bits or allocated for job.target
    run_part   a sharded source, one part (one shard) of it (higgs_engine.parts); an
               unsharded source is one run over the whole checkpoint (higgs_engine.pipeline)
    assemble   the artifacts' small files from the parts' metadata, and report.json

Whatever the kind, report.json is written once: the run's report, the plan's annotations and
the caller's job.annotate (given the staged output directory, its artifacts complete) are all
in it when it is written into the staged directory, which is then renamed to `out`.

A JobPlan is frozen, validated when it is built and serialisable (to_dict / from_dict, with a
version): a service stores it and runs its parts on other machines, each with the model
resolved there, and assembles from it; nothing is derived again.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from higgs_engine.calibration import CalibrationRequest
from higgs_engine.dynamic import ProfileSource
from higgs_engine.errors import InvalidConfigError
from higgs_engine.parts import Part, PartResult
from higgs_engine.planning.config import HiggsConfig, WholeFileFormat, check_method_job
from higgs_engine.planning.plans import Target, annotate_report
from higgs_engine.planning.profile import Profile
from higgs_engine.progress import ProgressCallback, report
from higgs_engine.report import Report
from higgs_engine.sources import ResolvedModel

if TYPE_CHECKING:
    from higgs_engine.calibration import Calibration
    from higgs_engine.gguf.runplan import GgufEvalRequest, GgufPlan

__all__ = [
    "JOB_PLAN_VERSION",
    "Annotate",
    "CalibrationRequest",
    "CtOptions",
    "DynamicChoice",
    "GgufOptions",
    "JobPlan",
    "ProfileSource",
    "QuantizeJob",
    "ResolvedModel",
    "RunInputs",
    "assemble",
    "gguf_plan",
    "measure_profile",
    "plan",
    "resolve",
    "run",
    "run_part",
]

JOB_PLAN_VERSION = 1
# A HIGGS plan, or one of each whole-file format (gguf, compressed-tensors): planned as data,
# run by its format's writer.
PlanKind = Literal["uniform", "dynamic", WholeFileFormat]

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

    def to_dict(self) -> dict[str, Any]:
        """The serialisable options (the evaluation text is the caller's, not the plan's)."""
        return {
            "bits": self.bits,
            "ftype": self.ftype,
            "rotate": self.rotate,
            "split_max_bytes": self.split_max_bytes,
            "threads": self.threads,
        }


@dataclass(frozen=True)
class CtOptions:
    """A compressed-tensors job (higgs_engine.ct.run): `bits` 4 (int4 W4A16) or 8 (int8 per
    channel) for every linear layer, or None with the job's target (the allocator's schemes
    over vLLM's menu); the checkpoint's 16-bit `dtype`."""

    bits: int | None = None
    dtype: str = "float16"


@dataclass(frozen=True)
class QuantizeJob:
    """One quantization: `source` (local directory or Hub id at `revision`, or a model
    resolved already) with `config`, uniform (target None) or allocated per layer for
    `target`; calibrated HIGGS with `calibration` (a Calibration, or a CalibrationRequest
    made into one once the model is resolved); on `device` (None: the CPU) with `threads`
    torch threads (None: torch's default). `gguf`: a GGUF file instead of HIGGS artifacts
    (`config` and `calibration` then refused). `annotate`: the caller's additions to the
    report, run before report.json is written; `on_plan`: told the JobPlan once it is made,
    before the quantization. `ct`: a compressed-tensors checkpoint for vLLM / transformers
    instead (`config` refused; with `calibration`, GPTQ in each layer's scheme). A job that
    cannot be planned fails here, naming the field."""

    source: str | Path | ResolvedModel
    config: HiggsConfig = field(default_factory=HiggsConfig)
    target: Target | None = None
    calibration: Calibration | CalibrationRequest | None = None
    profile: ProfileSource = field(default_factory=ProfileSource)
    device: str | None = None
    revision: str | None = None
    token: str | None = None
    overwrite: bool = False
    gguf: GgufOptions | None = None
    ct: CtOptions | None = None
    annotate: Annotate | None = None
    on_plan: Callable[[JobPlan], None] | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.config, HiggsConfig):
            raise InvalidConfigError(f"config: {type(self.config).__name__} is not a HiggsConfig")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise InvalidConfigError(f"threads={self.threads!r} must be a positive integer")
        if self.gguf is not None:
            if self.config != HiggsConfig():
                raise InvalidConfigError(
                    "config: a GGUF job takes llama.cpp's types, not a HIGGS config"
                )
            if self.calibration is not None:
                raise InvalidConfigError("calibration: a GGUF job is not calibrated")
        if self.ct is not None:
            if self.gguf is not None:
                raise InvalidConfigError(
                    "formats: a GGUF file and a compressed-tensors checkpoint are two jobs",
                    field="formats",
                )
            if self.config != HiggsConfig():
                raise InvalidConfigError(
                    "config: a compressed-tensors job takes vLLM's schemes, not a HIGGS config"
                )
            if (self.ct.bits is None) == (self.target is None):
                raise InvalidConfigError(
                    "bits: a compressed-tensors job takes bits (4 or 8) or a target, exactly one",
                    field="bits",
                )

    @property
    def kind(self) -> PlanKind:
        if self.gguf is not None:
            return "gguf"
        if self.ct is not None:
            return "compressed-tensors"
        return "dynamic" if self.target is not None else "uniform"


@dataclass(frozen=True)
class DynamicChoice:
    """What a dynamic plan chose and how: the target, the profile's provenance (`reused`: the
    store it came from, "given", or None when measured; the seconds spent on it, of which
    `generating_s` on self-generated text), the allocation's report entry and its seconds."""

    target: dict[str, float]
    reused: str | None
    profile_s: float
    generating_s: float
    allocating_s: float
    allocation: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": dict(self.target),
            "reused": self.reused,
            "profile_s": self.profile_s,
            "generating_s": self.generating_s,
            "allocating_s": self.allocating_s,
            "allocation": self.allocation,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DynamicChoice:
        return cls(
            target=dict(d["target"]),
            reused=d["reused"],
            profile_s=float(d["profile_s"]),
            generating_s=float(d["generating_s"]),
            allocating_s=float(d["allocating_s"]),
            allocation=dict(d["allocation"]),
        )


@dataclass(frozen=True)
class JobPlan:
    """Everything a run will do, as data: its `kind`; the `source` (the ResolvedModel's
    serialisable part: path, id, revision, kind); the `config` every layer is quantized with
    (a dynamic plan's per-layer grids are its overrides; the formats are config.formats);
    the `parts` of a sharded source with the layers each quantizes (`totals`; no parts: one
    run over the whole checkpoint); `device` and `threads`; the `calibration` used (its
    description; the token windows stay with the caller); the `profile` the report's alphas
    and predicted change come from; a dynamic plan's `dynamic` choice; a GGUF plan's `gguf`
    options; a compressed-tensors plan's `ct` entry (each layer's scheme, as data:
    higgs_engine.ct.run). Validated when built (InvalidConfigError naming the field)."""

    kind: PlanKind
    source: dict[str, Any]
    config: HiggsConfig
    parts: tuple[Part, ...] = ()
    totals: tuple[int, ...] = ()
    device: str = "cpu"
    threads: int | None = None
    calibration: dict[str, Any] | None = None
    profile: dict[str, Any] | None = None
    dynamic: DynamicChoice | None = None
    gguf: dict[str, Any] | None = None
    ct: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in get_args(PlanKind):
            raise InvalidConfigError(f"kind={self.kind!r} is not one of {get_args(PlanKind)}")
        if set(self.source) != {"path", "id", "revision", "kind"}:
            raise InvalidConfigError(f"source={self.source!r} needs path, id, revision, kind")
        if [p.index for p in self.parts] != list(range(len(self.parts))):
            raise InvalidConfigError("parts: their indexes are not 0..n-1 in order")
        if len(self.totals) != len(self.parts):
            raise InvalidConfigError(f"totals: {len(self.totals)} for {len(self.parts)} parts")
        if self.threads is not None and self.threads < 1:
            raise InvalidConfigError(f"threads={self.threads!r} must be a positive integer")
        if (self.kind == "dynamic") != (self.dynamic is not None):
            raise InvalidConfigError("dynamic: a dynamic plan, and only one, has its choice")
        if (self.kind == "gguf") != (self.gguf is not None):
            raise InvalidConfigError("gguf: a GGUF plan, and only one, has its options")
        if (self.kind == "compressed-tensors") != (self.ct is not None):
            raise InvalidConfigError(
                "ct: a compressed-tensors plan, and only one, has its schemes", field="ct"
            )
        if self.ct is not None:
            from higgs_engine.ct.run import check_ct_plan

            check_ct_plan(self.ct)
            if self.parts:
                raise InvalidConfigError("parts: a compressed-tensors plan is one run")
        if self.calibration is not None and self.parts:
            raise InvalidConfigError("calibration: a calibrated run is not split into parts")

    @property
    def sharded(self) -> bool:
        return bool(self.parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": JOB_PLAN_VERSION,
            "kind": self.kind,
            "source": dict(self.source),
            "config": self.config.to_dict(),
            "parts": [p.to_dict() for p in self.parts],
            "totals": list(self.totals),
            "device": self.device,
            "threads": self.threads,
            "calibration": self.calibration,
            "profile": self.profile,
            "dynamic": None if self.dynamic is None else self.dynamic.to_dict(),
            "gguf": self.gguf,
            "ct": self.ct,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobPlan:
        if not isinstance(d, Mapping) or d.get("version") != JOB_PLAN_VERSION:
            got = d.get("version") if isinstance(d, Mapping) else type(d).__name__
            raise InvalidConfigError(f"version: {got!r} is not job plan {JOB_PLAN_VERSION}")
        try:
            return cls(
                kind=d["kind"],
                source=dict(d["source"]),
                config=HiggsConfig.from_dict(d["config"]),
                parts=tuple(Part(int(p["index"]), tuple(p["shards"])) for p in d["parts"]),
                totals=tuple(int(t) for t in d["totals"]),
                device=str(d["device"]),
                threads=d["threads"],
                calibration=d["calibration"],
                profile=d["profile"],
                dynamic=None if d["dynamic"] is None else DynamicChoice.from_dict(d["dynamic"]),
                gguf=d["gguf"],
                ct=d.get("ct"),
            )
        except InvalidConfigError:
            raise  # names its field already
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidConfigError(f"job plan: {type(exc).__name__}: {exc}") from exc


@dataclass
class RunInputs:
    """What a run needs beside its plan, none of it data a plan carries: the model resolved
    on this machine, the progress callback, the caller's annotate, the calibration's token
    windows, this machine's device (None: the plan's) and the timings so far."""

    model: ResolvedModel
    progress: ProgressCallback | None = None
    annotate: Annotate | None = None
    calibration: Calibration | None = None
    device: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# resolve, plan
# ---------------------------------------------------------------------------------------------


def resolve(job: QuantizeJob, progress: ProgressCallback | None = None) -> ResolvedModel:
    """The job's model, resolved (stage "resolving"); a ResolvedModel source as it is."""
    from higgs_engine.sources import resolve_model

    report(progress, "resolving", 0, 1)
    model = resolve_model(job.source, job.revision, job.token)
    report(progress, "resolving", 1, 1)
    return model


def plan(
    job: QuantizeJob,
    progress: ProgressCallback | None = None,
    model: ResolvedModel | None = None,
    calibration: Calibration | None = None,
) -> JobPlan:
    """The JobPlan of `job` for `model` (resolved here when None): a dynamic target profiled
    and allocated (stages "profiling", "allocating"), a sharded data-free source's parts
    listed with the layers each quantizes. `calibration`: the job's calibration made into
    token windows already (its description goes into the plan)."""
    from higgs_engine.parts import planned_layers, source_parts

    model = model if model is not None else resolve(job, progress)
    cal = job.calibration if calibration is None else calibration
    if job.ct is not None:
        return _plan_ct(job, job.ct, model, progress, cal)
    config, profile, dynamic = job.config, job.profile.profile, None
    if job.target is not None and job.gguf is None:
        config, profile, dynamic = _plan_dynamic(job, job.target, model, progress)
    parts: list[Part] = []
    if model.sharded and cal is None and job.gguf is None:
        parts = source_parts(model)
    totals = planned_layers(model, parts, config) if parts else {}
    return JobPlan(
        kind=job.kind,
        source=model.ref(),
        config=config,
        parts=tuple(parts),
        totals=tuple(totals[p.index] for p in parts),
        device=job.device or "cpu",
        threads=job.threads,
        calibration=None if cal is None else _plain(_describe_calibration(cal)),
        profile=None if profile is None else _plain(profile.to_dict()),
        dynamic=dynamic,
        gguf=None if job.gguf is None else _plain(job.gguf.to_dict()),
    )


def _plan_ct(
    job: QuantizeJob,
    ct: CtOptions,
    model: ResolvedModel,
    progress: ProgressCallback | None,
    cal: Calibration | CalibrationRequest | None,
) -> JobPlan:
    """A compressed-tensors job's plan: every linear layer's scheme (higgs_engine.ct.run), and
    the calibration its layers are quantized with (GPTQ in their schemes), if any."""
    from higgs_engine.ct.run import plan_ct

    entry, profile = plan_ct(
        model, ct.bits, job.target, job.profile, ct.dtype, progress, job.device
    )
    return JobPlan(
        kind="compressed-tensors",
        source=model.ref(),
        config=job.config,
        device=job.device or "cpu",
        threads=job.threads,
        calibration=None if cal is None else _plain(_describe_calibration(cal)),
        profile=None if profile is None else _plain(profile.to_dict()),
        ct=entry,
    )


def _plain(d: Mapping[str, Any]) -> dict[str, Any]:
    """`d` as JSON gives it back (tuples become lists): a plan equals its stored copy."""
    out: dict[str, Any] = json.loads(json.dumps(dict(d)))
    return out


def _plan_dynamic(
    job: QuantizeJob, target: Target, model: ResolvedModel, progress: ProgressCallback | None
) -> tuple[HiggsConfig, Profile, DynamicChoice]:
    from higgs_engine.dynamic import plan_dynamic
    from higgs_engine.planning.plans import allocation_entry

    planned = plan_dynamic(model, target, job.config, job.profile, progress, job.device)
    prof = planned.profile
    choice = DynamicChoice(
        target=_plain(target.to_dict()),
        reused=prof.reused,
        profile_s=prof.seconds,
        generating_s=prof.generating_s,
        allocating_s=planned.allocating_s,
        allocation=_plain(allocation_entry(prof.profile.metric, planned.plan.allocation)),
    )
    return planned.config, prof.profile, choice


def _describe_calibration(cal: Calibration | CalibrationRequest) -> dict[str, Any]:
    if isinstance(cal, CalibrationRequest):
        return {"source": cal.label if cal.text is not None else "self", "tokens": cal.tokens}
    return cal.describe()


# ---------------------------------------------------------------------------------------------
# run_part, assemble, run
# ---------------------------------------------------------------------------------------------


def run_part(plan: JobPlan, index: int, out_dir: Path, inputs: RunInputs) -> PartResult:
    """Part `index` of the sharded plan quantized into `out_dir` (which must not exist): its
    shards of each format under their final names and part.json (higgs_engine.parts)."""
    from higgs_engine.parts import part_context, quantize_part

    if not 0 <= index < len(plan.parts):
        raise InvalidConfigError(f"index: part {index} is not one of {len(plan.parts)} parts")
    device = inputs.device or plan.device
    ctx = part_context(inputs.model, out_dir, plan.config, inputs.progress, device)
    with _threads(plan.threads):
        return quantize_part(ctx, plan.parts[index], len(plan.parts))


def assemble(
    plan: JobPlan,
    metas: Sequence[Mapping[str, Any]],
    out_dir: Path,
    inputs: RunInputs,
    part_dirs: Sequence[Path] | None = None,
) -> Report:
    """The artifacts of a sharded plan assembled into `out_dir` from every part's metadata
    (`metas`: their part.json): the small files and report.json, with the plan's annotations
    and then inputs.annotate. With `part_dirs` (the parts' output directories on this
    machine) their shards are moved beside the small files first; without, they are where
    the parts put them (a service's artifact store)."""
    from higgs_engine.parts import assemble_metadata, assemble_parts, part_context

    ctx = part_context(
        inputs.model, out_dir, plan.config, inputs.progress, inputs.device or plan.device
    )
    ctx.timings.update(inputs.timings)
    annotate = _chain([*_plan_annotations(plan), inputs.annotate])
    if part_dirs is None:
        return assemble_metadata(ctx, metas, annotate)
    return assemble_parts(ctx, part_dirs, annotate, move=True)


def run(job: QuantizeJob, out: Path, progress: ProgressCallback | None = None) -> Report:
    """Run `job` into `out` (atomic: nothing is left there on error or cancellation; an
    existing non-empty `out` only with job.overwrite) and return its Report, the one written
    as out/report.json: resolve once, plan, then run_part for each part and assemble (or the
    whole checkpoint in one run when the source is not sharded)."""
    out = Path(out)
    gguf, dynamic = job.gguf is not None, job.target is not None
    calibrated = job.calibration is not None
    check_method_job(job.config.method, calibrated=calibrated, dynamic=dynamic, gguf=gguf)
    if job.gguf is not None:
        from higgs_engine.gguf.run import GgufContext, run_gguf_plan

        ctx = GgufContext(job.profile, job.token, job.annotate, job.overwrite)
        return run_gguf_plan(gguf_plan(job, progress), out, progress, ctx)
    from higgs_engine.output import check_out_dir

    check_out_dir(out, job.overwrite)  # before any work: an existing output is refused first
    t0 = time.perf_counter()
    model = resolve(job, progress)
    inputs = RunInputs(model, progress, job.annotate, timings={})
    inputs.timings["resolving"] = time.perf_counter() - t0
    if isinstance(job.calibration, CalibrationRequest):
        from higgs_engine.calibration import prepare_calibration

        inputs.calibration = prepare_calibration(model, job.calibration, progress, job.device)
    else:
        inputs.calibration = job.calibration
    planned = plan(job, progress, model, inputs.calibration)
    if job.on_plan is not None:
        job.on_plan(planned)
    return _execute(planned, out, inputs, job.overwrite, t0)


def _execute(planned: JobPlan, out: Path, inputs: RunInputs, overwrite: bool, t0: float) -> Report:
    from higgs_engine.device import resolve_device
    from higgs_engine.output import atomic_output
    from higgs_engine.pipeline import quantize_whole
    from higgs_engine.run_core import RunContext

    with _threads(planned.threads), atomic_output(out, overwrite) as tmp:
        if planned.ct is not None:
            return _write_ct(planned, planned.ct, tmp, inputs, t0)
        if planned.sharded:
            return _run_parts(planned, tmp, inputs, t0)
        ctx = RunContext(
            model=inputs.model,
            tmp=tmp,
            config=planned.config,
            progress=inputs.progress,
            device=resolve_device(planned.device),
            timings=inputs.timings,
        )
        annotate = _chain([*_plan_annotations(planned), inputs.annotate])
        return quantize_whole(ctx, inputs.calibration, annotate, started=t0)


def _write_ct(
    planned: JobPlan, entry: Mapping[str, Any], tmp: Path, inputs: RunInputs, t0: float
) -> Report:
    """A compressed-tensors plan: the checkpoint, the plan's and the caller's annotations, then
    the one write of report.json."""
    from higgs_engine.ct.run import write_ct

    rep = write_ct(
        entry, inputs.model, tmp, inputs.progress, inputs.timings, calibration=inputs.calibration
    )
    rep.timings["total"] = time.perf_counter() - t0
    annotate = _chain([*_plan_annotations(planned), inputs.annotate])
    if annotate is not None:
        annotate(rep, tmp)
    rep.save(tmp / "report.json")
    return rep


def _run_parts(planned: JobPlan, tmp: Path, inputs: RunInputs, t0: float) -> Report:
    """A sharded source on one machine: every part, one after the other, into a scratch
    directory beside `tmp`, then assembled into `tmp` exactly as parts run by many workers
    would be."""
    from dataclasses import replace

    from higgs_engine.parts import read_part

    total = sum(planned.totals)
    scratch = tmp.with_name(tmp.name + ".parts")
    try:
        t1 = time.perf_counter()
        dirs: list[Path] = []
        for part, offset in zip(planned.parts, _offsets(planned.totals), strict=True):
            d = scratch / f"part-{part.index:05d}"
            shifted = replace(inputs, progress=_shifted(inputs.progress, offset, total))
            run_part(planned, part.index, d, shifted)
            dirs.append(d)
        inputs.timings["quantizing"] = time.perf_counter() - t1
        inputs.timings["total"] = time.perf_counter() - t0
        return assemble(planned, [read_part(d) for d in dirs], tmp, inputs, part_dirs=dirs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _offsets(totals: Sequence[int]) -> list[int]:
    out, at = [], 0
    for t in totals:
        out.append(at)
        at += t
    return out


def _shifted(progress: ProgressCallback | None, offset: int, total: int) -> ProgressCallback | None:
    """A part's progress as the whole run's: its layers after the earlier parts' (`offset`)."""
    if progress is None:
        return None

    def shifted(stage: str, done: int, _total: int) -> bool | None:
        return progress(stage, offset + done, total)

    return shifted


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the block (None: left as they are)."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# The report's annotations, from the plan
# ---------------------------------------------------------------------------------------------


def _plan_annotations(planned: JobPlan) -> list[Annotate]:
    """What the plan adds to the report: a dynamic plan its alphas and predicted change, the
    allocation, the target and the profiling / allocating seconds; a given profile with a
    uniform plan each layer's alpha and the predicted change."""
    if planned.profile is None:
        return []
    profile = Profile.from_dict(planned.profile)
    dyn = planned.dynamic

    def annotate(rep: Report, _staged: Path) -> None:
        annotate_report(rep, profile)
        if dyn is None:
            return
        rep.metrics["allocation"] = dyn.allocation
        rep.metrics["target"] = dict(dyn.target)
        rep.timings["allocating"] = dyn.allocating_s
        if dyn.reused is None:
            # profiling: the Fisher passes (and loading); generating: the text they ran on
            rep.timings["profiling"] = dyn.profile_s - dyn.generating_s
            if dyn.generating_s:
                rep.timings["generating"] = dyn.generating_s

    return [annotate]


def _chain(hooks: Sequence[Annotate | None]) -> Annotate | None:
    todo = [h for h in hooks if h is not None]
    if not todo:
        return None

    def annotate(rep: Report, staged: Path) -> None:
        for hook in todo:
            hook(rep, staged)

    return annotate


# ---------------------------------------------------------------------------------------------
# The profile alone (`higgs profile`), GGUF
# ---------------------------------------------------------------------------------------------


def measure_profile(
    job: QuantizeJob, progress: ProgressCallback | None = None, compute: bool = True
) -> Profile:
    """The profile a dynamic plan of `job` would use (job.profile: given, found in its stores
    or measured on job.device and saved), of the layers job.config quantizes less
    job.profile.skip; without planning or quantizing anything."""
    from higgs_engine.dynamic import obtain_profile

    if job.profile.profile is not None:
        return job.profile.profile
    model = resolve(job, progress)
    skip = job.config.skip if job.profile.skip is None else job.profile.skip
    layers = model.layer_names(skip, embeddings=job.config.scope == "all")
    return obtain_profile(model, job.profile, layers, progress, job.device, compute).profile


def gguf_plan(job: QuantizeJob, progress: ProgressCallback | None = None) -> GgufPlan:
    """The GgufPlan of a GGUF job: its options validated first (InvalidConfigError naming the
    bad option), then the source resolved once (stage "resolving") and planned; run() runs
    it."""
    from higgs_engine.gguf.runplan import (
        GgufCompute,
        GgufGoal,
        GgufLayout,
        GgufRotation,
        plan_gguf,
    )

    if job.gguf is None:
        raise InvalidConfigError(f"the job for {str(job.source)!r} asks for no GGUF file")
    g = job.gguf
    goal = GgufGoal(g.bits, g.ftype, job.target)
    rotation = GgufRotation(g.rotate)
    layout = (
        GgufLayout() if g.split_max_bytes is None else GgufLayout(split_max_bytes=g.split_max_bytes)
    )
    compute = GgufCompute(job.device, g.threads)
    model = resolve(job, progress)
    return plan_gguf(model, goal, rotation, layout, compute, job.profile.config, g.evaluate)
