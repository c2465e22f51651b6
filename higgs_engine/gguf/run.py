"""A GGUF file for llama.cpp, end to end: the `gguf` format of the CLI and of the service.
run_gguf_plan(plan, out, progress, context) runs a GgufPlan (higgs_engine.gguf.runplan: made
by plan_gguf, which resolved nothing itself but read the resolved model's config once) in stages:

    converting  llama.cpp's converter -> a 16-bit GGUF (architecture metadata, tokenizer, chat
                template), split into llama.cpp's -0000k-of-0000N.gguf shards above the plan's
                `layout.split_max_bytes`; the rotated checkpoint's too when a candidate is rotated
    profiling   (avg_bits / max_ppl_increase) the model's data-free profile with the token
                embedding and output head included, shared with dynamic HIGGS (cached), on the
                plan's device
    measuring   t^2 of every tensor in every type of the menu, with llama.cpp's kernels, in the
                plan's threads
    allocating  the exact DP allocator picks one llama.cpp type per tensor for each candidate
                plan; the plan gets its choices (GgufChoices), pick_rotation keeps one candidate
    quantizing  llama_model_quantize with one exact-name override per tensor of the plan's
                choices (llama.cpp's own mixture for an ftype plan)
    evaluating  (optional) perplexity / KL (or 1 - cos) in llama.cpp against the 16-bit file
    packaging   the caller's annotations (GgufContext.annotate), report.json (written once),
                then the output directory appears whole (atomic rename)

Rotation (`rotation.mode`, llama-family decoders: higgs_engine.gguf.rotate): "on" converts the
rotated checkpoint (RMSNorm weights folded into the linears, the residual stream rotated by a
seeded orthogonal matrix, V/O rotated per head, a tied head untied) instead of the original;
"auto" with a planning target gives two candidate plans (runplan.rotation_candidates), converts,
measures and allocates both and keeps the one whose allocation predicts the lower change at the
target (for a max_ppl_increase target: the smaller file), recording both predictions; without a
planning target "auto" stays unrotated (nothing to compare). An avg_bits budget is the unrotated
file's bytes: the rotated file, one head matrix larger when the head was tied, gets the same
tensor bytes, so its own bits per weight come out lower. Quality is evaluated against the
unrotated 16-bit file. Models outside the llama family: "on" is refused when planning
(InvalidConfigError), "auto" stays unrotated.

Targets (the plan's goal): `bits` is one llama.cpp type everywhere (Q4_K for 4, rows it does
not fit taking llama.cpp's own fallback); `ftype` is one of llama.cpp's own mixtures
(Q4_K_M...), for comparison; a planning Target (avg_bits over the whole file, as llama.cpp
counts bits per weight, or max_ppl_increase) is the allocator's.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from higgs_engine.errors import InfeasibleTargetError, InvalidConfigError
from higgs_engine.gguf.convert import convert_checkpoint
from higgs_engine.gguf.llama import LlamaError, llama_version, quantize_file
from higgs_engine.gguf.plan import (
    GgufAllocation,
    GgufFile,
    allocate_gguf,
    build_gguf_problem,
    measure_errors,
    read_gguf,
    tensor_alphas,
    uniform_allocation,
)
from higgs_engine.gguf.rotate import rotated_alphas, write_rotated_checkpoint
from higgs_engine.gguf.runplan import (
    GgufChoices,
    GgufPlan,
    pick_rotation,
    rotation_candidates,
)
from higgs_engine.planning.allocator import Problem
from higgs_engine.planning.gguf_types import GGUF_TYPES, GgufType, uniform_type_for_bits
from higgs_engine.planning.plans import metric_bound_for_ppl, ppl_increase_from
from higgs_engine.planning.profile import Profile
from higgs_engine.progress import ProgressCallback, report
from higgs_engine.report import LayerReport, Report

if TYPE_CHECKING:
    from higgs_engine.dynamic import ProfileSource

__all__ = ["GgufContext", "run_gguf_plan"]

# llama_model_quantize writes general.file_type from its ftype; a mixed file is labelled with
# llama.cpp's mixture of the type that holds the most weights.
_FTYPE_OF = {
    "Q2_K": "Q2_K",
    "Q3_K": "Q3_K_M",
    "IQ3_S": "IQ3_S",
    "IQ4_XS": "IQ4_XS",
    "IQ4_NL": "IQ4_NL",
    "Q4_0": "Q4_0",
    "Q4_1": "Q4_1",
    "Q4_K": "Q4_K_M",
    "Q5_0": "Q5_0",
    "Q5_1": "Q5_1",
    "Q5_K": "Q5_K_M",
    "Q6_K": "Q6_K",
    "Q8_0": "Q8_0",
    "F16": "Q8_0",  # an F16 file type would switch off the per-tensor overrides
}


@dataclass(frozen=True)
class GgufContext:
    """What a run uses that is not a decision of its plan: where the profile comes from
    (`profile`: given, or found in its stores and otherwise measured with its text; None: the
    data-free profile, measured and not kept), the Hub `token`, the caller's `annotate` (given
    the staged output directory, the GGUF file there, before report.json is written) and
    whether an existing non-empty output directory may be replaced; `on_plan` is told the plan
    kept, its choices made, before the file is quantized."""

    profile: ProfileSource | None = None
    token: str | None = None
    annotate: Callable[[Report, Path], None] | None = None
    overwrite: bool = False
    on_plan: Callable[[GgufPlan], None] | None = None


def run_gguf_plan(
    plan: GgufPlan,
    out: Path,
    progress: ProgressCallback | None = None,
    context: GgufContext | None = None,
) -> Report:
    """Run `plan`: `out`/gguf/<name>.gguf (or its shards) and `out`/report.json; the directory
    appears only once complete (nothing is left there on error or cancellation)."""
    from higgs_engine.output import atomic_output, scratch_dir

    ctx = context or GgufContext()
    with atomic_output(Path(out), ctx.overwrite) as tmp, scratch_dir(Path(out)) as scratch:
        tmp.mkdir()
        return _run(_Run(plan, ctx, progress, scratch), tmp)


@dataclass
class _Run:
    """One run's plan, context and scratch directory, and the seconds of its stages."""

    plan: GgufPlan
    ctx: GgufContext
    progress: ProgressCallback | None
    scratch: Path
    timings: dict[str, float] = field(default_factory=dict)

    def timed(self, stage: str, t0: float) -> None:
        self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - t0


@dataclass(frozen=True)
class _Converted:
    """A 16-bit GGUF file (its shards) and, for the rotated checkpoint's, the rotation's
    description (what write_rotated_checkpoint did, the parameters it added)."""

    shards: list[Path]
    file: GgufFile
    rotation: dict[str, Any] | None = None


@dataclass(frozen=True)
class _Candidate:
    """A candidate plan with its choices, its 16-bit file and what they came from."""

    plan: GgufPlan
    f16: _Converted
    t2: np.ndarray  # (tensors, menu types)
    alphas: np.ndarray | None  # per tensor; None without a profile
    unprofiled: list[str]


def _run(run: _Run, tmp: Path) -> Report:
    t_start = time.perf_counter()
    candidates = rotation_candidates(run.plan)
    plain, rotated = _convert(run, any(c.rotated for c in candidates))
    profile = _profile(run) if run.plan.goal.target is not None else None
    chosen, allocated = _allocate(run, candidates, (plain, rotated), profile)
    if run.ctx.on_plan is not None:
        run.ctx.on_plan(chosen.plan)
    written, ftype = _quantize(run, chosen, tmp)
    metrics = _metrics(chosen, written, ftype, profile)
    if rotated is not None:
        metrics["rotation"] = _rotation_entry(rotated, allocated)
    if chosen.plan.rotated:
        tensor_bytes = written.fixed_bytes + sum(written.bytes_of.values())
        metrics["bits_per_unrotated_weight"] = 8.0 * tensor_bytes / plain.file.params_total
    if run.plan.evaluate is not None:
        _evaluate(run, written, plain, metrics)
    report(run.progress, "packaging", 0, 1)
    run.timings["total"] = time.perf_counter() - t_start
    rep = _report(run, chosen, written, metrics)
    if run.ctx.annotate is not None:
        run.ctx.annotate(rep, tmp)
    rep.save(tmp / "report.json")
    report(run.progress, "packaging", 1, 1)
    return rep


def _convert(run: _Run, with_rotated: bool) -> tuple[_Converted, _Converted | None]:
    """The 16-bit file of the checkpoint and, `with_rotated`, of its rotated twin."""
    t0 = time.perf_counter()
    report(run.progress, "converting", 0, 1)
    plan = run.plan
    src = plan.source.path
    split = plan.layout.split_max_bytes
    src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    split_bytes = split if src_bytes > split else None
    base = _file_stem(plan.source.id)
    convert_checkpoint(src, run.scratch / f"{base}-f16.gguf", split_max_bytes=split_bytes)
    shards = sorted(run.scratch.glob(f"{base}-f16*.gguf"))
    plain = _Converted(shards, read_gguf(shards))
    rotated = None
    if with_rotated:
        rc = write_rotated_checkpoint(src, run.scratch / "rotated", seed=plan.rotation.seed)
        rf16 = run.scratch / f"{base}-rot-f16.gguf"
        convert_checkpoint(rc.path, rf16, outtype=rc.outtype, split_max_bytes=split_bytes)
        shutil.rmtree(rc.path, ignore_errors=True)
        rshards = sorted(run.scratch.glob(f"{base}-rot-f16*.gguf"))
        rfile = read_gguf(rshards)
        about = {
            **rc.plan,
            "added_params": rc.added_params,
            "params_unrotated": plain.file.params_total,
            "params_rotated": rfile.params_total,
        }
        rotated = _Converted(rshards, rfile, about)
    report(run.progress, "converting", 1, 1)
    run.timed("converting", t0)
    return plain, rotated


def _allocate(
    run: _Run,
    candidates: tuple[GgufPlan, ...],
    files: tuple[_Converted, _Converted | None],
    profile: Profile | None,
) -> tuple[_Candidate, list[_Candidate | InfeasibleTargetError]]:
    """Each candidate measured and allocated, in order (stages "measuring", "allocating"),
    and the one kept. A rotated candidate beside an unrotated one may be infeasible (the
    rotation adds a head matrix): it is then recorded and the unrotated one kept."""
    plain, rotated = files
    allocated: list[_Candidate | InfeasibleTargetError] = []
    for cand in candidates:
        f16 = rotated if cand.rotated else plain
        if f16 is None:
            raise LlamaError("the rotated checkpoint was not converted")
        t2 = _measure(run, f16.file)
        t0 = time.perf_counter()
        report(run.progress, "allocating", 0, 1)
        try:
            allocated.append(_choose(run, cand, f16, t2, (profile, plain.file.params_total)))
        except InfeasibleTargetError as e:
            if not cand.rotated or len(candidates) == 1:
                raise
            allocated.append(e)
        report(run.progress, "allocating", 1, 1)
        run.timed("allocating", t0)
    done = [c for c in allocated if isinstance(c, _Candidate)]
    if len(done) == 1:
        return done[0], allocated
    kept = pick_rotation(done[0].plan, done[1].plan)
    return (done[1] if kept is done[1].plan else done[0]), allocated


def _measure(run: _Run, f: GgufFile) -> np.ndarray:
    t0 = time.perf_counter()
    out = measure_errors(
        f,
        run.plan.layout.menu,
        sample_values=run.plan.layout.sample_values,
        threads=run.plan.compute.thread_count,
        progress=run.progress,
    )
    run.timed("measuring", t0)
    return out


def _choose(
    run: _Run,
    cand: GgufPlan,
    f16: _Converted,
    t2: np.ndarray,
    profiled: tuple[Profile | None, int],
) -> _Candidate:
    """`cand` with its choices for the plan's goal (none for an ftype: llama.cpp's own
    mixture). `profiled`: the profile and the unrotated file's parameters, over which an
    avg_bits budget is counted (a rotated file with an untied head gets the same bytes)."""
    profile, base_params = profiled
    f = f16.file
    alphas: np.ndarray | None = None
    unprofiled: list[str] = []
    if profile is not None:
        per_module = profile.alphas()
        if cand.rotated:
            untied = bool((f16.rotation or {}).get("untied_head"))
            per_module = rotated_alphas(per_module, untied=untied)
        alphas, unprofiled = tensor_alphas(f, per_module)
    if cand.choices is not None:  # decided before this run: quantized with exactly those
        missing = sorted({t.name for t in f.tensors} - set(cand.choices.types))
        if missing:
            raise InvalidConfigError(
                f"the plan's choices give no type for {missing[:5]}", field="choices"
            )
        return _Candidate(cand, f16, t2, alphas, unprofiled)
    menu = run.plan.layout.menu
    zeros = np.zeros(len(f.tensors))
    problem = build_gguf_problem(f, alphas if alphas is not None else zeros, t2, menu)
    goal = cand.goal
    bound = None
    if goal.target is not None and profile is not None:
        if goal.target.avg_bits is not None:
            alloc = _within_budget(f, problem, cand, base_params)
        else:
            ppl = goal.target.max_ppl_increase or 0.0
            bound = metric_bound_for_ppl(profile.metric, ppl)
            alloc = allocate_gguf(f, problem, menu, max_predicted=bound)
    elif goal.bits is not None:
        alloc = uniform_allocation(f, problem, uniform_type_for_bits(goal.bits), menu)
    else:
        return _Candidate(cand, f16, t2, alphas, unprofiled)
    choices = GgufChoices(
        {n: t.name for n, t in alloc.types.items()},
        alloc.predicted if profile is not None else None,
        alloc.tensor_bytes,
        bound,
    )
    return _Candidate(cand.with_choices(choices), f16, t2, alphas, unprofiled)


def _within_budget(
    f: GgufFile, problem: Problem, cand: GgufPlan, base_params: int
) -> GgufAllocation:
    """The allocation of `f` for the plan's avg_bits counted over `base_params` (the unrotated
    file's parameters)."""
    avg_bits = cand.goal.target.avg_bits if cand.goal.target is not None else None
    if avg_bits is None:
        raise InfeasibleTargetError("an avg_bits budget needs an avg_bits target")
    menu = cand.layout.menu
    try:
        return allocate_gguf(f, problem, menu, avg_bits=avg_bits * base_params / f.params_total)
    except InfeasibleTargetError:
        if base_params == f.params_total:
            raise
        lo = (problem.min_avg_bits() * f.params_quantizable + 8.0 * f.fixed_bytes) / base_params
        raise InfeasibleTargetError(
            f"avg_bits={avg_bits:g} is below the smallest rotated GGUF file "
            f"for this model ({lo:.3f} bits per unrotated weight: the rotation unties "
            "the head, one more matrix to store)"
        ) from None


def _profile(run: _Run) -> Profile:
    """The profile of the plan's source (embeddings and head included) on the plan's device:
    the context's own, found in its stores, or measured (stage "profiling")."""
    from higgs_engine.dynamic import ProfileSource, obtain_profile
    from higgs_engine.sources import ResolvedModel, resolve_model

    source = run.ctx.profile or ProfileSource()
    if source.profile is not None:
        return source.profile
    t0 = time.perf_counter()
    plan = run.plan
    model = plan.source
    if not isinstance(model, ResolvedModel):
        model = resolve_model(model.path, plan.source.revision, run.ctx.token)
    how = replace(source, config=plan.profile or source.config)
    layers = model.layer_names((), embeddings=True)
    got = obtain_profile(model, how, layers, run.progress, device=plan.compute.device)
    if got.reused is None:
        run.timed("profiling", t0)
    return got.profile


def _quantize(run: _Run, chosen: _Candidate, tmp: Path) -> tuple[GgufFile, str]:
    """llama.cpp's quantizer on the kept candidate's 16-bit file with the plan's types (or its
    ftype's mixture); the file read back and checked against the plan."""
    t0 = time.perf_counter()
    plan = chosen.plan
    n_tensors = len(chosen.f16.file.tensors)  # llama.cpp's quantizer writes them in one call
    report(run.progress, "quantizing", 0, n_tensors)
    out_sub = tmp / "gguf"
    out_sub.mkdir()
    shards = chosen.f16.shards
    split = len(shards) > 1
    out_first = out_sub / f"{_file_stem(plan.source.id)}-{plan.goal.label}.gguf"
    types: dict[str, GgufType] | None = None
    if plan.choices is not None:
        types = {n: GGUF_TYPES[t] for n, t in plan.choices.types.items()}
        ftype = _file_ftype(chosen.f16.file, plan.choices)
    elif plan.goal.ftype is not None:
        ftype = plan.goal.ftype
    else:
        raise InvalidConfigError("a plan without choices is llama.cpp's ftype's", field="ftype")
    dst = out_first.with_suffix("") if split else out_first  # llama.cpp adds -0000k-of-0000N
    quantize_file(
        shards[0],
        dst,
        ftype=ftype,
        tensor_types=types,
        threads=plan.compute.thread_count,
        keep_split=split,
    )
    files = sorted(out_sub.glob("*.gguf"))
    if not files:
        raise LlamaError(f"llama.cpp wrote no file for {plan.source.id}")
    written = read_gguf(files, quantized=True)
    if types is not None:
        wrong = {
            n: (types[n].name, got)
            for n, got in written.types.items()
            if n in types and types[n].name != got
        }
        if wrong:
            raise LlamaError(
                f"llama.cpp stored other types than allocated: {dict(list(wrong.items())[:5])}"
            )
    report(run.progress, "quantizing", n_tensors, n_tensors)
    run.timed("quantizing", t0)
    return written, ftype


def _metrics(
    chosen: _Candidate,
    written: GgufFile,
    ftype: str,
    profile: Profile | None,
) -> dict[str, Any]:
    """The report's GGUF metrics: the files, their types, the rotation kept, the prediction."""
    plan = chosen.plan
    metrics: dict[str, Any] = {
        "gguf_files": [p.name for p in written.paths],
        "gguf_file_type": ftype,
        "gguf_architecture": chosen.f16.file.arch,
        "llama_cpp_version": llama_version(),
        "menu": [t.name for t in plan.layout.menu],
        "t2_sample_values": plan.layout.sample_values,
        "type_histogram": _histogram(written.types, chosen.f16.file),
        "rotate": plan.rotation.mode,
        "rotated": plan.rotated,
    }
    if chosen.unprofiled:
        metrics["unprofiled_tensors"] = chosen.unprofiled
    choices = plan.choices
    if profile is not None and choices is not None and choices.predicted is not None:
        metrics.update(
            profile_key=profile.key(),
            profile_metric=profile.metric,
            predicted_change=choices.predicted,
            predicted_ppl_increase=ppl_increase_from(profile.metric, choices.predicted),
            target=plan.goal.target.to_dict() if plan.goal.target is not None else None,
        )
        if choices.metric_bound is not None:
            metrics["metric_bound"] = choices.metric_bound
    return metrics


def _rotation_entry(
    rotated: _Converted, allocated: list[_Candidate | InfeasibleTargetError]
) -> dict[str, Any]:
    """What the rotation did and, with two candidates, both predictions (or why the rotated
    one was infeasible)."""
    entry = dict(rotated.rotation or {})
    if len(allocated) == 2:
        plain, rot = allocated
        if isinstance(rot, InfeasibleTargetError):
            entry["infeasible"] = str(rot)
        elif isinstance(plain, _Candidate) and plain.plan.choices and rot.plan.choices:
            a, b = plain.plan.choices, rot.plan.choices
            entry.update(
                predicted_change_plain=a.predicted,
                predicted_change_rotated=b.predicted,
                tensor_bytes_plain=a.tensor_bytes,
                tensor_bytes_rotated=b.tensor_bytes,
            )
    return entry


def _evaluate(run: _Run, written: GgufFile, plain: _Converted, metrics: dict[str, Any]) -> None:
    """The file against the unrotated 16-bit file in llama.cpp (stage "evaluating")."""
    from higgs_engine.gguf.evaluate import evaluate_gguf

    ask = run.plan.evaluate
    if ask is None:
        return
    t0 = time.perf_counter()
    ev = evaluate_gguf(
        written.paths[0],
        plain.shards[0],
        ask.text,
        encoder=run.plan.model.encoder,
        context=ask.context,
        windows=ask.windows,
        threads=run.plan.compute.thread_count,
        progress=run.progress,
    )
    metrics.update(ev.to_dict())
    metrics["eval_text"] = ask.name
    predicted = metrics.get("predicted_change")
    if predicted is not None:
        metrics["measured_change"] = ev.measured
        metrics["predicted_over_measured"] = predicted / ev.measured if ev.measured > 0 else None
    run.timed("evaluating", t0)


def _file_stem(source: str) -> str:
    name = source.rstrip("/").split("/")[-1] or "model"
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
    return safe.removesuffix(".gguf") or "model"


def _file_ftype(gf: GgufFile, choices: GgufChoices) -> str:
    weight: dict[str, int] = {}
    for t in gf.tensors:
        name = choices.types[t.name]
        weight[name] = weight.get(name, 0) + t.numel
    top = max(sorted(weight), key=lambda n: weight[n])
    return _FTYPE_OF.get(top, "Q8_0")


def _histogram(types: dict[str, str], gf: GgufFile) -> dict[str, int]:
    names = {t.name for t in gf.tensors}
    out: dict[str, int] = {}
    for n, t in types.items():
        if n in names:
            out[t] = out.get(t, 0) + 1
    return dict(sorted(out.items()))


def _report(run: _Run, chosen: _Candidate, written: GgufFile, metrics: dict[str, Any]) -> Report:
    from higgs_engine.run_core import versions

    plan, gf = chosen.plan, chosen.f16.file
    layers, q_numel = _layer_rows(chosen, written)
    tensor_bytes = written.fixed_bytes + sum(written.bytes_of.values())
    file_bytes = sum(p.stat().st_size for p in written.paths)
    metrics["file_bytes"] = file_bytes
    metrics["tensor_bytes"] = tensor_bytes
    metrics["bits_per_linear_weight"] = _linear_bits(gf, written)
    config: dict[str, Any] = {
        "format": "gguf",
        **plan.goal.to_dict(),
        **plan.layout.to_dict(),
        "rotate": plan.rotation.mode,
    }
    return Report(
        # llama.cpp's figure: tensor data bits over every parameter of the file
        bits_per_weight=8.0 * tensor_bytes / gf.params_total,
        bits_per_param_total=8.0 * file_bytes / gf.params_total,
        bytes_before=sum(p.stat().st_size for p in plan.source.path.glob("*.safetensors")),
        bytes_after=file_bytes,
        params_total=gf.params_total,
        params_quantized=q_numel,
        layers=layers,
        timings=dict(run.timings),
        config=config,
        source={
            "id": plan.source.id,
            "revision": plan.source.revision,
            "kind": plan.source.kind,
            "architecture": plan.model.architecture,
            "model_type": plan.model.model_type,
        },
        versions={**versions(), "llama_cpp_python": llama_version()},
        seed=0,
        formats=["gguf"],
        metrics=json.loads(json.dumps(metrics)),
    )


def _layer_rows(chosen: _Candidate, written: GgufFile) -> tuple[list[LayerReport], int]:
    """One report row per quantizable tensor (its type, bits, t^2 and alpha) and the weights
    quantized (those not kept in 16 bits)."""
    pos = {t.name: j for j, t in enumerate(chosen.plan.layout.menu)}
    t2, alphas = chosen.t2, chosen.alphas
    layers = []
    q_numel = 0
    for i, t in enumerate(chosen.f16.file.tensors):
        tname = written.types.get(t.name, "F16")
        ty = GGUF_TYPES.get(tname)
        nbytes = written.bytes_of.get(t.name, 0)
        err = float(t2[i, pos[tname]]) if tname in pos and np.isfinite(t2[i, pos[tname]]) else 0.0
        if ty is not None and not ty.keep:
            q_numel += t.numel
        layers.append(
            LayerReport(
                name=t.name,
                shape=[t.rows, t.cols],
                p=0,
                n=0,
                bits=8.0 * nbytes / t.numel,
                rel_error=err,
                bytes=nbytes,
                alpha=float(alphas[i]) if alphas is not None else None,
                type=tname,
            )
        )
    return layers, q_numel


def _linear_bits(gf: GgufFile, written: GgufFile) -> float:
    """Bits per weight over the transformer blocks' 2-D weights alone (no embeddings / head)."""
    names = [t for t in gf.tensors if t.name.startswith("blk.")]
    numel = sum(t.numel for t in names)
    return 8.0 * sum(written.bytes_of.get(t.name, 0) for t in names) / numel if numel else 0.0
