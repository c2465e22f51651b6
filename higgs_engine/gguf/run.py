"""A GGUF file for llama.cpp, end to end: the `gguf` format of the CLI and of the service.

    resolving   the checkpoint (local directory or Hub snapshot)
    converting  llama.cpp's converter -> a 16-bit GGUF (architecture metadata, tokenizer, chat
                template), split into llama.cpp's -0000k-of-0000N.gguf shards above
                `split_max_bytes`
    profiling   (avg_bits / max_ppl_increase) the model's data-free profile with the token
                embedding and output head included, shared with dynamic HIGGS (cached)
    measuring   t^2 of every tensor in every type of the menu, with llama.cpp's kernels
    allocating  the exact DP allocator picks one llama.cpp type per tensor
    quantizing  llama_model_quantize with one exact-name override per tensor
    evaluating  (optional) perplexity / KL (or 1 - cos) in llama.cpp against the 16-bit file
    packaging   the caller's annotations (GgufRun.annotate), report.json (written once), then
                the output directory appears whole (atomic rename)

Rotation (`rotate`, llama-family decoders: higgs_engine/gguf/rotate.py): "on" converts the
rotated checkpoint (RMSNorm weights folded into the linears, the residual stream rotated by a
seeded orthogonal matrix, V/O rotated per head, a tied head untied) instead of the original;
"auto" converts and measures both and keeps the one whose allocation predicts the lower change
at the target (for a max_ppl_increase target: the smaller file), recording both predictions;
without a planning target "auto" stays unrotated (nothing to compare). An avg_bits budget is
the unrotated file's bytes: the rotated file, one head matrix larger when the head was tied,
gets the same tensor bytes, so its own bits per weight come out lower. Quality is evaluated
against the unrotated 16-bit file. Models outside the llama family: "on" is refused
(InvalidConfigError), "auto" stays unrotated.

Targets: `bits` is one llama.cpp type everywhere (Q4_K for 4, rows it does not fit taking
llama.cpp's own fallback); `ftype` is one of llama.cpp's own mixtures (Q4_K_M...), for
comparison; a planning Target (avg_bits over the whole file, as llama.cpp counts bits per
weight, or max_ppl_increase) is the allocator's.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from higgs_engine.errors import InfeasibleTargetError, InvalidConfigError
from higgs_engine.gguf.convert import check_architecture, convert_checkpoint
from higgs_engine.gguf.llama import FTYPES, LlamaError, llama_version, quantize_file
from higgs_engine.gguf.plan import (
    DEFAULT_SAMPLE_VALUES,
    GgufAllocation,
    GgufFile,
    allocate_gguf,
    build_gguf_problem,
    measure_errors,
    read_gguf,
    tensor_alphas,
    uniform_allocation,
)
from higgs_engine.gguf.rotate import ROTATABLE, rotated_alphas, write_rotated_checkpoint
from higgs_engine.planning.gguf_types import GGUF_MENU, GGUF_TYPES, GgufType, uniform_type_for_bits
from higgs_engine.planning.plans import Target, metric_bound_for_ppl, ppl_increase_from
from higgs_engine.planning.profile import DEFAULT_PROFILE, Profile, ProfileConfig, ProfileStore
from higgs_engine.progress import ProgressCallback, report
from higgs_engine.report import LayerReport, Report

# The 16-bit conversion is split into shards of at most this many bytes (llama.cpp's split
# files; the quantized file keeps the same number of shards).
DEFAULT_SPLIT_BYTES = 8 * 1024**3

ROTATE_MODES = ("off", "on", "auto")
DEFAULT_ROTATE = "off"

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
class GgufEvalRequest:
    """Evaluate the file in llama.cpp on `text` (None: no evaluation)."""

    text: str
    name: str = "text"
    context: int | None = None
    windows: int | None = None


@dataclass
class GgufRun:
    """What one quantize_gguf run works with."""

    source: str | Path
    out_dir: Path
    bits: float | None = None
    target: Target | None = None
    ftype: str | None = None
    profile: Profile | None = None
    profile_config: ProfileConfig = DEFAULT_PROFILE
    profile_text: str | None = None
    stores: Sequence[ProfileStore] = ()
    selfgen_cache: Path | None = None
    evaluate: GgufEvalRequest | None = None
    menu: tuple[GgufType, ...] = GGUF_MENU
    sample_values: int = DEFAULT_SAMPLE_VALUES
    split_max_bytes: int = DEFAULT_SPLIT_BYTES
    converter: Path | None = None
    revision: str | None = None
    token: str | None = None
    threads: int = 0
    progress: ProgressCallback | None = None
    overwrite: bool = False
    rotate: str = DEFAULT_ROTATE
    rotation_seed: int = 0
    # What the caller adds to the report, given the staged output directory (the GGUF file is
    # there), before report.json is written and the directory renamed into place.
    annotate: Callable[[Report, Path], None] | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rotate not in ROTATE_MODES:
            raise InvalidConfigError(
                f"rotate={self.rotate!r} must be one of {list(ROTATE_MODES)}", field="rotate"
            )
        given = [x is not None for x in (self.bits, self.target, self.ftype)]
        if sum(given) != 1:
            raise InvalidConfigError("give exactly one of bits, a target and a llama.cpp ftype")
        if self.ftype is not None and self.ftype not in FTYPES:
            raise InvalidConfigError(
                f"ftype={self.ftype!r} is not one of llama.cpp's file types {sorted(FTYPES)}",
                field="ftype",
            )
        if self.bits is not None:
            uniform_type_for_bits(self.bits)  # raises for bits below Q2_K
        if self.split_max_bytes < 1024**2:
            raise InvalidConfigError(
                f"split_max_bytes={self.split_max_bytes} must be at least 1 MiB",
                field="split_max_bytes",
            )


def quantize_gguf(run: GgufRun) -> Report:
    """Write `run.out_dir`/gguf/<name>.gguf (or its shards) and `run.out_dir`/report.json; the
    directory appears only once complete (nothing is left there on error or cancellation)."""
    from higgs_engine.output import atomic_output, scratch_dir

    with atomic_output(run.out_dir, run.overwrite) as tmp, scratch_dir(run.out_dir) as scratch:
        tmp.mkdir()
        return _run(run, tmp, scratch)


def _timed(run: GgufRun, stage: str, t0: float) -> None:
    run.timings[stage] = run.timings.get(stage, 0.0) + time.perf_counter() - t0


def shard_files(first: Path) -> list[Path]:
    """A GGUF file, or all shards of a split one given any of them, in order."""
    name = first.name
    if "-of-" in name and name.endswith(".gguf"):
        stem = name.rsplit("-", 3)[0]
        return sorted(first.parent.glob(f"{stem}-*-of-*.gguf"))
    return [first]


def _run(run: GgufRun, tmp: Path, scratch: Path) -> Report:
    from higgs_engine.model_structure import load_config, model_kind
    from higgs_engine.sources import resolve_source

    t_start = time.perf_counter()
    t0 = time.perf_counter()
    report(run.progress, "resolving", 0, 1)
    src = resolve_source(run.source, run.revision, run.token)
    hf_config = load_config(src.path)
    archs = list(getattr(hf_config, "architectures", None) or [])
    check_architecture(archs, run.converter)
    encoder = model_kind(hf_config) != "causal"
    rotatable = getattr(hf_config, "model_type", None) in ROTATABLE
    if run.rotate == "on" and not rotatable:
        raise InvalidConfigError(
            f"rotate='on' applies to llama-family decoders ({', '.join(sorted(ROTATABLE))}); "
            f"this checkpoint is {archs[0] if archs else '(no architecture)'} "
            f"(model_type {getattr(hf_config, 'model_type', None)!r})",
            field="rotate",
        )
    report(run.progress, "resolving", 1, 1)
    _timed(run, "resolving", t0)

    t0 = time.perf_counter()
    report(run.progress, "converting", 0, 1)
    src_bytes = sum(p.stat().st_size for p in src.path.glob("*.safetensors"))
    split_bytes = run.split_max_bytes if src_bytes > run.split_max_bytes else None
    base_name = _file_stem(str(run.source))
    f16 = scratch / f"{base_name}-f16.gguf"
    convert_checkpoint(src.path, f16, converter=run.converter, split_max_bytes=split_bytes)
    f16_shards = sorted(scratch.glob(f"{base_name}-f16*.gguf"))
    base_shards = f16_shards  # the unrotated 16-bit file: what evaluation compares against
    gf = read_gguf(f16_shards)
    base_params = gf.params_total
    rot_info: dict[str, Any] | None = None
    want_rotation = run.rotate == "on" or (
        run.rotate == "auto" and rotatable and run.target is not None
    )
    if want_rotation:
        rc = write_rotated_checkpoint(src.path, scratch / "rotated", seed=run.rotation_seed)
        rf16 = scratch / f"{base_name}-rot-f16.gguf"
        convert_checkpoint(
            rc.path,
            rf16,
            outtype=rc.outtype,
            converter=run.converter,
            split_max_bytes=split_bytes,
        )
        shutil.rmtree(rc.path, ignore_errors=True)
        rot_shards = sorted(scratch.glob(f"{base_name}-rot-f16*.gguf"))
        rgf = read_gguf(rot_shards)
        rot_info = {
            **rc.plan,
            "added_params": rc.added_params,
            "params_unrotated": base_params,
            "params_rotated": rgf.params_total,
        }
    report(run.progress, "converting", 1, 1)
    _timed(run, "converting", t0)

    profile = None
    alphas = None
    unprofiled: list[str] = []
    if run.target is not None:
        profile = _profile(run)
        alphas, unprofiled = tensor_alphas(gf, profile.alphas())

    def measure(g: GgufFile) -> np.ndarray:
        t0 = time.perf_counter()
        out = measure_errors(
            g,
            run.menu,
            sample_values=run.sample_values,
            threads=max(1, run.threads or 2),
            progress=run.progress,
        )
        _timed(run, "measuring", t0)
        return out

    t2 = measure(gf) if run.rotate != "on" else np.zeros((0, len(run.menu)))

    t0 = time.perf_counter()
    report(run.progress, "allocating", 0, 1)
    alloc: GgufAllocation | None = None
    bound = None
    if run.rotate != "on":
        alloc, bound = _allocate(run, gf, alphas, t2, profile, gf.params_total)
    rotated = False
    if want_rotation:
        assert rot_info is not None
        report(run.progress, "allocating", 1, 1)
        _timed(run, "allocating", t0)
        rt2 = measure(rgf)
        t0 = time.perf_counter()
        ralphas = None
        runprofiled: list[str] = []
        if profile is not None:
            ralphas, runprofiled = tensor_alphas(
                rgf, rotated_alphas(profile.alphas(), untied=rot_info["untied_head"])
            )
        try:
            ralloc, rbound = _allocate(run, rgf, ralphas, rt2, profile, gf.params_total)
        except InfeasibleTargetError as e:
            if run.rotate == "on":
                raise
            ralloc, rbound = None, None
            rot_info["infeasible"] = str(e)
        if run.rotate == "on":
            rotated = True
        elif ralloc is not None and alloc is not None:
            assert run.target is not None
            if run.target.avg_bits is not None:
                rotated = ralloc.predicted < alloc.predicted
            else:
                rotated = ralloc.tensor_bytes < alloc.tensor_bytes
            rot_info.update(
                predicted_change_plain=alloc.predicted,
                predicted_change_rotated=ralloc.predicted,
                tensor_bytes_plain=alloc.tensor_bytes,
                tensor_bytes_rotated=ralloc.tensor_bytes,
            )
        if rotated:
            gf, f16_shards, t2, alphas, unprofiled = rgf, rot_shards, rt2, ralphas, runprofiled
            alloc, bound = ralloc, rbound
    report(run.progress, "allocating", 1, 1)
    _timed(run, "allocating", t0)

    t0 = time.perf_counter()
    report(run.progress, "quantizing", 0, 1)
    out_sub = tmp / "gguf"
    out_sub.mkdir()
    split = len(f16_shards) > 1
    label = _label(run)
    out_first = out_sub / f"{base_name}-{label}.gguf"
    if alloc is not None:
        ftype = _file_ftype(gf, alloc)
        types: dict[str, GgufType] | None = alloc.types
    else:
        assert run.ftype is not None
        ftype, types = run.ftype, None
    dst = out_first.with_suffix("") if split else out_first  # llama.cpp adds -0000k-of-0000N
    quantize_file(f16_shards[0], dst, ftype=ftype, tensor_types=types, keep_split=split)
    shards = sorted(out_sub.glob("*.gguf"))
    if not shards:
        raise LlamaError(f"llama.cpp wrote no file for {base_name}")
    written = read_gguf(shards, quantized=True)
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
    report(run.progress, "quantizing", 1, 1)
    _timed(run, "quantizing", t0)

    metrics: dict[str, Any] = {
        "gguf_files": [p.name for p in shards],
        "gguf_file_type": ftype,
        "gguf_architecture": gf.arch,
        "llama_cpp_version": llama_version(),
        "menu": [t.name for t in run.menu],
        "t2_sample_values": run.sample_values,
        "type_histogram": _histogram(written.types, gf),
        "rotate": run.rotate,
        "rotated": rotated,
    }
    if rot_info is not None:
        metrics["rotation"] = rot_info
    if rotated:
        tensor_bytes = written.fixed_bytes + sum(written.bytes_of.values())
        metrics["bits_per_unrotated_weight"] = 8.0 * tensor_bytes / base_params
    if unprofiled:
        metrics["unprofiled_tensors"] = unprofiled
    predicted = None
    if profile is not None and alloc is not None:
        predicted = alloc.predicted
        metrics.update(
            profile_key=profile.key(),
            profile_metric=profile.metric,
            predicted_change=predicted,
            predicted_ppl_increase=ppl_increase_from(profile.metric, predicted),
            target=run.target.to_dict() if run.target is not None else None,
        )
        if bound is not None:
            metrics["metric_bound"] = bound

    if run.evaluate is not None:
        from higgs_engine.gguf.evaluate import evaluate_gguf

        t0 = time.perf_counter()
        ev = evaluate_gguf(
            shards[0],
            base_shards[0],
            run.evaluate.text,
            encoder=encoder,
            context=run.evaluate.context,
            windows=run.evaluate.windows,
            threads=run.threads,
            progress=run.progress,
        )
        metrics.update(ev.to_dict())
        metrics["eval_text"] = run.evaluate.name
        if predicted is not None:
            metrics["measured_change"] = ev.measured
            metrics["predicted_over_measured"] = (
                predicted / ev.measured if ev.measured > 0 else None
            )
        _timed(run, "evaluating", t0)

    report(run.progress, "packaging", 0, 1)
    run.timings["total"] = time.perf_counter() - t_start
    rep = _report(run, src, hf_config, gf, written, t2, alphas, metrics)
    if run.annotate is not None:
        run.annotate(rep, tmp)
    rep.save(tmp / "report.json")
    report(run.progress, "packaging", 1, 1)
    return rep


def _allocate(
    run: GgufRun,
    gf: GgufFile,
    alphas: np.ndarray | None,
    t2: np.ndarray,
    profile: Profile | None,
    base_params: int,
) -> tuple[GgufAllocation | None, float | None]:
    """The allocation for `gf` at the run's target (None for an ftype run) and the metric bound
    of a max_ppl_increase target. An avg_bits budget is counted over `base_params` (the
    unrotated file's parameters): a rotated file with an untied head gets the same bytes."""
    problem = build_gguf_problem(
        gf, alphas if alphas is not None else np.zeros(len(gf.tensors)), t2, run.menu
    )
    if run.target is not None:
        assert profile is not None
        if run.target.avg_bits is not None:
            avg = run.target.avg_bits * base_params / gf.params_total
            try:
                return allocate_gguf(gf, problem, run.menu, avg_bits=avg), None
            except InfeasibleTargetError:
                if base_params == gf.params_total:
                    raise
                lo = (problem.min_avg_bits() * gf.params_quantizable + 8.0 * gf.fixed_bytes) / (
                    base_params
                )
                raise InfeasibleTargetError(
                    f"avg_bits={run.target.avg_bits:g} is below the smallest rotated GGUF file "
                    f"for this model ({lo:.3f} bits per unrotated weight: the rotation unties "
                    "the head, one more matrix to store)"
                ) from None
        assert run.target.max_ppl_increase is not None
        bound = metric_bound_for_ppl(profile.metric, run.target.max_ppl_increase)
        return allocate_gguf(gf, problem, run.menu, max_predicted=bound), bound
    if run.bits is not None:
        return uniform_allocation(gf, problem, uniform_type_for_bits(run.bits), run.menu), None
    return None, None


def _profile(run: GgufRun) -> Profile:
    from higgs_engine.dynamic import ProfileSource, obtain_profile
    from higgs_engine.sources import resolve_model

    if run.profile is not None:
        return run.profile
    t0 = time.perf_counter()
    model = resolve_model(run.source, run.revision, run.token)
    how = ProfileSource(
        config=run.profile_config,
        text=run.profile_text,
        stores=tuple(run.stores),
        selfgen_cache=run.selfgen_cache,
    )
    got = obtain_profile(model, how, model.layer_names((), embeddings=True), run.progress)
    if got.reused is None:
        _timed(run, "profiling", t0)
    return got.profile


def _label(run: GgufRun) -> str:
    if run.ftype is not None:
        return run.ftype
    if run.bits is not None:
        return uniform_type_for_bits(run.bits).name
    assert run.target is not None
    if run.target.avg_bits is not None:
        return f"higgs-{run.target.avg_bits:g}bpw"
    return f"higgs-ppl{run.target.max_ppl_increase:g}"


def _file_stem(source: str) -> str:
    name = source.rstrip("/").split("/")[-1] or "model"
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
    return safe.removesuffix(".gguf") or "model"


def _file_ftype(gf: GgufFile, alloc: GgufAllocation) -> str:
    weight: dict[str, int] = {}
    for t in gf.tensors:
        name = alloc.types[t.name].name
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


def _report(
    run: GgufRun,
    src: Any,
    hf_config: Any,
    gf: GgufFile,
    written: GgufFile,
    t2: np.ndarray,
    alphas: np.ndarray | None,
    metrics: dict[str, Any],
) -> Report:
    from higgs_engine.run_core import versions

    pos = {t.name: j for j, t in enumerate(run.menu)}
    layers = []
    q_numel = 0
    for i, t in enumerate(gf.tensors):
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
    tensor_bytes = written.fixed_bytes + sum(written.bytes_of.values())
    file_bytes = sum(p.stat().st_size for p in written.paths)
    metrics["file_bytes"] = file_bytes
    metrics["tensor_bytes"] = tensor_bytes
    metrics["bits_per_linear_weight"] = _linear_bits(gf, written)
    config: dict[str, Any] = {
        "format": "gguf",
        "bits": run.bits,
        "target": run.target.to_dict() if run.target is not None else None,
        "ftype": run.ftype,
        "menu": [t.name for t in run.menu],
        "sample_values": run.sample_values,
        "split_max_bytes": run.split_max_bytes,
        "rotate": run.rotate,
    }
    return Report(
        # llama.cpp's figure: tensor data bits over every parameter of the file
        bits_per_weight=8.0 * tensor_bytes / gf.params_total,
        bits_per_param_total=8.0 * file_bytes / gf.params_total,
        bytes_before=sum(p.stat().st_size for p in Path(src.path).glob("*.safetensors")),
        bytes_after=file_bytes,
        params_total=gf.params_total,
        params_quantized=q_numel,
        layers=layers,
        timings=dict(run.timings),
        config=config,
        source={
            "id": str(run.source),
            "revision": src.revision,
            "kind": src.kind,
            "architecture": (getattr(hf_config, "architectures", None) or [None])[0],
            "model_type": getattr(hf_config, "model_type", None),
        },
        versions={**versions(), "llama_cpp_python": llama_version()},
        seed=0,
        formats=["gguf"],
        metrics=json.loads(json.dumps(metrics)),
    )


def _linear_bits(gf: GgufFile, written: GgufFile) -> float:
    """Bits per weight over the transformer blocks' 2-D weights alone (no embeddings / head)."""
    names = [t for t in gf.tensors if t.name.startswith("blk.")]
    numel = sum(t.numel for t in names)
    return 8.0 * sum(written.bytes_of.get(t.name, 0) for t in names) / numel if numel else 0.0
