"""quantize_checkpoint: the one entry point the CLI and the service call.

Streaming: tensors are read one at a time from the source safetensors, quantized (or cast to
16 bits) and appended to the output files, so peak memory is bounded by the largest tensor
(plus its quantization temporaries), not by the model.

Atomic output: everything is written into a temporary sibling of `out_dir` and renamed at the
end; on any error or cancellation the temporary directory is removed and `out_dir` is left as
it was (absent).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.errors import InvalidConfigError
from higgs_engine.model_structure import LayerSpec, is_skipped, load_config, scope_specs
from higgs_engine.output import atomic_output
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.progress import ProgressCallback, report
from higgs_engine.report import LayerReport, Report
from higgs_engine.safetensors_stream import CheckpointReader, read_weight_map
from higgs_engine.sources import ResolvedSource, resolve_source

if TYPE_CHECKING:
    import torch

    from higgs_engine.artifacts import ArtifactWriter
    from higgs_engine.calibration import Calibration
    from higgs_engine.quantize import QuantizedMatrix


# ---------------------------------------------------------------------------------------------
# One layer
# ---------------------------------------------------------------------------------------------


def quantize_layer_full(
    w: torch.Tensor,
    p: int,
    n: int,
    config: HiggsConfig,
    device: torch.device | str | None = None,
) -> tuple[QuantizedMatrix, torch.Tensor, float]:
    """Quantize one (out, in) float32 weight with grid (p, n) on `device` (default CPU):
    (q, W_hat float32 on the CPU, t^2)."""
    from higgs_engine.quantize import quantize_matrix_full, relative_error

    q, w_hat = quantize_matrix_full(
        w,
        p,
        n,
        group_size=config.group_size,
        rotation_block=config.rotation_block,
        sign_seed=config.sign_seed,
        device=device,
        scale_rule=config.scale_rule,
    )
    assert w_hat is not None
    return q, w_hat, float(relative_error(w, w_hat))


def quantize_layer(
    w: torch.Tensor, p: int, n: int, config: HiggsConfig
) -> tuple[QuantizedMatrix, float]:
    """Quantize one (out, in) weight with grid (p, n) under `config`: (q, relative error t^2)."""
    q, _, err = quantize_layer_full(w, p, n, config)
    return q, err


# ---------------------------------------------------------------------------------------------
# Planning: which layer gets which grid
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerPlan:
    spec: LayerSpec
    grid: tuple[int, int] | None  # (p, n), or None = keep 16-bit
    reason: str | None  # why a layer stays 16-bit


def plan_layers(specs: list[LayerSpec], config: HiggsConfig) -> list[LayerPlan]:
    """Apply skip patterns, per-layer overrides and shape constraints to every candidate layer."""
    names = {s.name for s in specs}
    unknown = [o.name for o in config.overrides if o.name not in names]
    if unknown:
        raise InvalidConfigError(f"overrides name layers the model does not have: {unknown[:5]}")
    plans = []
    for s in specs:
        if is_skipped(s.name, config.skip):
            plans.append(LayerPlan(s, None, "skip pattern"))
            continue
        grid = config.grid_for(s.name)
        if grid is None:
            plans.append(LayerPlan(s, None, "override keeps 16 bits"))
        elif s.in_features % grid[0]:
            plans.append(
                LayerPlan(s, None, f"in_features={s.in_features} is not divisible by p={grid[0]}")
            )
        else:
            plans.append(LayerPlan(s, grid, None))
    return plans


def calibrate_layers(
    path: Path,
    hf_config: object,
    reader: CheckpointReader,
    todo: list[LayerPlan],
    config: HiggsConfig,
    calibration: Calibration,
    progress: ProgressCallback | None = None,
) -> tuple[dict[str, QuantizedMatrix], dict[str, object]]:
    """Calibrated HIGGS of every planned layer: GPTQ with the layer's HIGGS grid and the Hessian
    of its inputs from the block-by-block pass. Returns ({name: q}, the report's calibration
    entry). Layers the pass cannot reach (outside the transformer blocks) are left out of the
    dict: the pipeline quantizes them without data and the entry lists them."""
    from higgs_engine.calibration import run_calibrated
    from higgs_engine.gptq import DEFAULT_BLOCK, DEFAULT_DAMP, gptq_higgs_many

    # The token embedding and an output head (scope "all") are quantized without data.
    todo = [pl for pl in todo if pl.spec.role == "linear"]
    grids: dict[str, tuple[int, int]] = {
        pl.spec.name: pl.grid for pl in todo if pl.grid is not None
    }
    out: dict[str, QuantizedMatrix] = {}

    def quantize(
        group: list[LayerSpec], ws: list[torch.Tensor], hessian: torch.Tensor
    ) -> list[torch.Tensor]:
        # Layers with one input and one grid are swept together (rows are independent).
        w_hats: dict[str, torch.Tensor] = {}
        for grid in dict.fromkeys(grids[s.name] for s in group):
            idx = [i for i, s in enumerate(group) if grids[s.name] == grid]
            res = gptq_higgs_many(
                [ws[i] for i in idx],
                hessian,
                grid[0],
                grid[1],
                group_size=config.group_size,
                rotation_block=config.rotation_block,
                sign_seed=config.sign_seed,
                scale_rule=config.scale_rule,
            )
            for i, (q, w_hat) in zip(idx, res, strict=True):
                out[group[i].name] = q
                w_hats[group[i].name] = w_hat
        return [w_hats[s.name] for s in group]

    outside = run_calibrated(
        path, hf_config, reader, [pl.spec for pl in todo], calibration, quantize, progress
    )
    info: dict[str, object] = {
        **calibration.describe(),
        "method": "gptq",
        "damp": DEFAULT_DAMP,
        "block": DEFAULT_BLOCK,
        "layers_calibrated": len(out),
        "layers_without_data": outside,
    }
    return out, info


# ---------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    import platform

    import safetensors
    import torch
    import transformers

    import higgs_engine

    return {
        "higgs_engine": higgs_engine.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
    }


def quantize_checkpoint(
    source: str | Path,
    out_dir: Path,
    config: HiggsConfig,
    progress: ProgressCallback | None = None,
    *,
    revision: str | None = None,
    token: str | None = None,
    overwrite: bool = False,
    cache_dir: Path | None = None,
    hub_cache_dir: Path | None = None,
    local_files_only: bool = False,
    device: str | None = None,
    calibration: Calibration | None = None,
) -> Report:
    """Quantize `source` (local dir, .gguf file or Hub id) into `out_dir` and return the Report.

    Writes out_dir/native/, out_dir/dequantized/ (as config.formats says) and out_dir/report.json.
    progress(stage, done, total) is called for stages resolving, loading, quantizing (done/total =
    layers) and packaging; returning False or raising CancelledError cancels the run at the next
    layer boundary. On any error nothing is left at `out_dir`. An existing non-empty `out_dir`
    is refused unless `overwrite`, in which case it is replaced only once the new one is ready.
    device: where rotation and search run ("auto" = CUDA when usable; default the CPU); the
    checkpoint is still streamed tensor by tensor and the artifacts written from the CPU.
    calibration: calibrated HIGGS (GPTQ with HIGGS grids, higgs_engine.gptq) with the Hessians
    of a block-by-block pass over these token windows (stage "calibrating", layers done/total);
    the artifacts have the same format, only codes and scales differ. The report's
    metrics["calibration"] says which text (sha256, tokens) was used.
    """
    from higgs_engine.device import resolve_device

    dev = resolve_device(device or "cpu")
    with atomic_output(out_dir, overwrite) as tmp:
        return _run(
            _RunContext(
                source=source,
                tmp=tmp,
                config=config,
                progress=progress,
                revision=revision,
                token=token,
                cache_dir=cache_dir,
                hub_cache_dir=hub_cache_dir,
                local_files_only=local_files_only,
                device=dev,
                calibration=calibration,
            )
        )


@dataclass
class _RunContext:
    """What one quantize_checkpoint run works with; `timings` fills in stage by stage."""

    source: str | Path
    tmp: Path  # the temporary output directory, renamed to out_dir at the end
    config: HiggsConfig
    progress: ProgressCallback | None
    revision: str | None
    token: str | None
    cache_dir: Path | None
    hub_cache_dir: Path | None
    local_files_only: bool
    device: torch.device
    calibration: Calibration | None = None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class _Written:
    """What the quantizing and packaging stages produced, for the report."""

    rows: dict[str, LayerReport]
    files: dict[str, dict[str, int]]
    grid_bytes: int
    native_bytes: int
    bytes_before: int
    params_total: int
    calibration: dict[str, object] | None


def _run(ctx: _RunContext) -> Report:
    t_start = time.perf_counter()
    src = _resolve(ctx)
    weight_map = read_weight_map(src.path)
    if ctx.calibration is None and weight_map is not None and len(set(weight_map.values())) > 1:
        return _run_parts(ctx, src, t_start)
    t0 = time.perf_counter()
    report(ctx.progress, "loading", 0, 1)
    hf_config = load_config(src.path)
    with CheckpointReader(src.path) as reader:
        specs = scope_specs(hf_config, reader.keys(), ctx.config.scope)
        plans = plan_layers(specs, ctx.config)
        report(ctx.progress, "loading", 1, 1)
        ctx.timings["loading"] = time.perf_counter() - t0
        written = _write_artifacts(ctx, src.path, hf_config, reader, plans)
    ctx.timings["total"] = time.perf_counter() - t_start
    rep = _build_report(ctx, src, hf_config, specs, plans, written)
    rep.save(ctx.tmp / "report.json")
    report(ctx.progress, "packaging", 1, 1)
    return rep


def _run_parts(ctx: _RunContext, src: ResolvedSource, t_start: float) -> Report:
    """A sharded source (data-free): one part per shard, one after the other, assembled into
    sharded artifacts (higgs_engine.parts) exactly as parts run by many workers would be."""
    from higgs_engine.parts import assemble_parts, planned_layers, quantize_part, source_parts

    t0 = time.perf_counter()
    report(ctx.progress, "loading", 0, 1)
    parts = source_parts(src.path)
    totals = planned_layers(src.path, parts, ctx.config)
    report(ctx.progress, "loading", 1, 1)
    ctx.timings["loading"] = time.perf_counter() - t0
    total = sum(totals.values())
    scratch = ctx.tmp.with_name(ctx.tmp.name + ".parts")
    try:
        t0 = time.perf_counter()
        dirs = []
        offset = 0
        for part in parts:

            def progress(stage: str, done: int, _total: int, offset: int = offset) -> bool | None:
                if ctx.progress is None:
                    return None
                return ctx.progress(stage, offset + done, total)

            d = scratch / f"part-{part.index:05d}"
            quantize_part(
                src.path, part, d, ctx.config, progress, device=str(ctx.device), n_parts=len(parts)
            )
            dirs.append(d)
            offset += totals[part.index]
        ctx.timings["quantizing"] = time.perf_counter() - t0
        ctx.timings["total"] = time.perf_counter() - t_start
        return assemble_parts(
            src.path,
            dirs,
            ctx.tmp,
            ctx.config,
            ctx.progress,
            resolved=ResolvedSource(src.path, str(ctx.source), src.revision, src.kind),
            move=True,
            timings=ctx.timings,
            device=str(ctx.device),
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _resolve(ctx: _RunContext) -> ResolvedSource:
    t0 = time.perf_counter()
    report(ctx.progress, "resolving", 0, 1)
    src = resolve_source(
        ctx.source,
        ctx.revision,
        ctx.token,
        cache_dir=ctx.cache_dir,
        hub_cache_dir=ctx.hub_cache_dir,
        local_files_only=ctx.local_files_only,
    )
    report(ctx.progress, "resolving", 1, 1)
    ctx.timings["resolving"] = time.perf_counter() - t0
    return src


def _write_artifacts(
    ctx: _RunContext,
    path: Path,
    hf_config: object,
    reader: CheckpointReader,
    plans: list[LayerPlan],
) -> _Written:
    """Stages calibrating (if asked), quantizing and packaging into ctx.tmp."""
    from higgs_engine.artifacts import ArtifactWriter

    t0 = time.perf_counter()
    todo = [pl for pl in plans if pl.grid is not None]
    report(ctx.progress, "quantizing", 0, len(todo))
    ctx.tmp.mkdir()
    config = ctx.config
    writer = ArtifactWriter(ctx.tmp, config.formats, config.dtype, path, config.to_dict())
    try:
        calibrated: dict[str, QuantizedMatrix] = {}
        cal_info: dict[str, object] | None = None
        if ctx.calibration is not None:
            t_cal = time.perf_counter()
            calibrated, cal_info = calibrate_layers(
                path, hf_config, reader, todo, config, ctx.calibration, ctx.progress
            )
            ctx.timings["calibrating"] = time.perf_counter() - t_cal
        rows = _stream_tensors(ctx, reader, plans, writer, calibrated, len(todo))
        ctx.timings["quantizing"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        report(ctx.progress, "packaging", 0, 1)
        files = writer.finish()
    except BaseException:
        writer.abort()
        raise
    written = _Written(
        rows=rows,
        files=files,
        grid_bytes=writer.grid_bytes,
        native_bytes=writer.native_bytes,
        bytes_before=reader.total_bytes,
        params_total=sum(reader.numel(k) for k in reader),
        calibration=cal_info,
    )
    ctx.timings["packaging"] = time.perf_counter() - t0
    return written


def _stream_tensors(
    ctx: _RunContext,
    reader: CheckpointReader,
    plans: list[LayerPlan],
    writer: ArtifactWriter,
    calibrated: dict[str, QuantizedMatrix],
    total: int,
) -> dict[str, LayerReport]:
    """Every tensor of the checkpoint, in file order, into the writer: planned layers
    quantized (or taken from `calibrated`), the rest cast. Returns the per-layer rows."""
    by_key = {pl.spec.key: pl for pl in plans}
    rows: dict[str, LayerReport] = {}
    done = 0
    for key in reader:
        pl = by_key.get(key)
        if pl is None or pl.grid is None:
            nbytes = writer.add_plain(key, reader.get(key))
            if pl is not None:
                writer.keep_layer(pl.spec.name)
                bits = 8.0 * nbytes / pl.spec.numel
                rows[pl.spec.name] = _layer_row(pl.spec, 0, 0, bits, 0.0, nbytes)
            continue
        rows[pl.spec.name] = _quantize_one(ctx, reader, pl.spec, pl.grid, writer, calibrated)
        done += 1
        # Between layers: the callback may cancel (False / CancelledError).
        report(ctx.progress, "quantizing", done, total)
    return rows


def _quantize_one(
    ctx: _RunContext,
    reader: CheckpointReader,
    spec: LayerSpec,
    grid: tuple[int, int],
    writer: ArtifactWriter,
    calibrated: dict[str, QuantizedMatrix],
) -> LayerReport:
    """One planned layer: quantized with its (p, n) grid (or calibrated), written, its row."""
    p, n = grid
    w = spec.weight(reader)  # (out, in) float32
    if spec.name in calibrated:
        from higgs_engine.quantize import dequantize_matrix, relative_error

        q = calibrated.pop(spec.name)
        w_hat = dequantize_matrix(q)
        err = float(relative_error(w, w_hat))
    else:
        q, w_hat, err = quantize_layer_full(w, p, n, ctx.config, ctx.device)
    del w
    nbytes = writer.add_quantized(spec, q, w_hat)
    del w_hat
    return _layer_row(spec, p, n, float(q.bits_per_weight()), err, nbytes)


def _layer_row(
    spec: LayerSpec, p: int, n: int, bits: float, rel_error: float, nbytes: int
) -> LayerReport:
    return LayerReport(
        name=spec.name,
        shape=[spec.out_features, spec.in_features],
        p=p,
        n=n,
        bits=bits,
        rel_error=rel_error,
        bytes=nbytes,
    )


def _build_report(
    ctx: _RunContext,
    src: ResolvedSource,
    hf_config: Any,
    specs: list[LayerSpec],
    plans: list[LayerPlan],
    written: _Written,
) -> Report:
    config = ctx.config
    layers = [written.rows[s.name] for s in specs]
    # bits_per_weight stays over the linear layers whatever the scope (the grids counted there)
    linear = [s for s in specs if s.role == "linear"]
    lin_numel = sum(s.numel for s in linear)
    lin_bytes = sum(written.rows[s.name].bytes for s in linear) + written.grid_bytes
    quantized = [r for r in layers if r.p]
    q_numel = sum(r.shape[0] * r.shape[1] for r in quantized)
    metrics: dict[str, Any] = {
        "linear_layers": len(linear),
        "quantized_layers": len(quantized),
        "kept_16bit": {pl.spec.name: pl.reason for pl in plans if pl.grid is None},
        "grid_bytes": written.grid_bytes,
        "code_bits": config.code_bits,
        "device": str(ctx.device),
        "mean_rel_error": (
            sum(r.rel_error * r.shape[0] * r.shape[1] for r in quantized) / q_numel
            if q_numel
            else 0.0
        ),
        "files": written.files,
    }
    if written.calibration is not None:
        metrics["calibration"] = written.calibration
    if config.scope != "linear":
        metrics["scope"] = config.scope
        metrics["embedding_layers"] = {s.name: s.role for s in specs if s.role != "linear"}
    return Report(
        bits_per_weight=8.0 * lin_bytes / lin_numel,
        bits_per_param_total=8.0 * written.native_bytes / written.params_total,
        bytes_before=written.bytes_before,
        bytes_after=written.native_bytes,
        params_total=written.params_total,
        params_quantized=q_numel,
        layers=layers,
        timings=ctx.timings,
        config=config.to_dict(),
        source={
            "id": str(ctx.source),
            "revision": src.revision,
            "kind": src.kind,
            "architecture": (getattr(hf_config, "architectures", None) or [None])[0],
            "model_type": hf_config.model_type,
        },
        versions=versions(),
        seed=config.seed,
        formats=list(config.formats),
        metrics=metrics,
    )
