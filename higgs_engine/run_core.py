"""The run core shared by the whole-checkpoint pipeline (higgs_engine.pipeline) and the
part-by-part runs (higgs_engine.parts): one layer quantized, the layer plan (which layer gets
which grid), a run's context, every tensor of a checkpoint streamed into the artifact writer,
and the report built from what was written.

The orchestrators (pipeline, parts) import this module; it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.checkpoint_check import check_tensor_finite
from higgs_engine.errors import InvalidConfigError
from higgs_engine.methods import Precision, method
from higgs_engine.model_structure import LayerSpec, is_skipped
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.progress import ProgressCallback, report
from higgs_engine.report import LayerReport, Report

if TYPE_CHECKING:
    import torch

    from higgs_engine.artifacts import ArtifactWriter
    from higgs_engine.quantize import QuantizedMatrix
    from higgs_engine.safetensors_stream import CheckpointReader
    from higgs_engine.sources import ResolvedModel

__all__ = [
    "LayerPlan",
    "RunContext",
    "Written",
    "build_report",
    "plan_layers",
    "stream_tensors",
    "versions",
]


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


# ---------------------------------------------------------------------------------------------
# A run: its context, the tensors streamed, the report
# ---------------------------------------------------------------------------------------------


@dataclass
class RunContext:
    """What one run (the whole checkpoint, one part of it, or the assembly) works with: the
    model resolved once, the output directory, the config, where it runs; `timings` fills in
    stage by stage."""

    model: ResolvedModel
    tmp: Path  # the output directory (the staged one, renamed to the output at the end)
    config: HiggsConfig
    progress: ProgressCallback | None
    device: torch.device
    timings: dict[str, float] = field(default_factory=dict)
    # The registered method (higgs_engine.methods.METHODS) that quantizes each planned layer
    # without data; None: the config's (HiggsConfig.data_free_method).
    method: str | None = None


@dataclass
class Written:
    """What the quantizing and packaging stages produced, for the report."""

    rows: dict[str, LayerReport]
    files: dict[str, dict[str, int]]
    grid_bytes: int
    native_bytes: int
    bytes_before: int
    params_total: int
    calibration: dict[str, object] | None


def stream_tensors(
    ctx: RunContext,
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
            tensor = reader.get(key)
            check_tensor_finite(key, tensor)  # quantized layers check theirs as they go
            nbytes = writer.add_plain(key, tensor)
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
    ctx: RunContext,
    reader: CheckpointReader,
    spec: LayerSpec,
    grid: tuple[int, int],
    writer: ArtifactWriter,
    calibrated: dict[str, QuantizedMatrix],
) -> LayerReport:
    """One planned layer: quantized with its (p, n) grid (or calibrated), written, its row."""
    from higgs_engine.quantize import dequantize_matrix, relative_error

    p, n = grid
    w = spec.weight(reader)  # (out, in) float32
    q: QuantizedMatrix | None
    if spec.name in calibrated:
        q = calibrated.pop(spec.name)
        w_hat = dequantize_matrix(q)
        bits = float(q.bits_per_weight())
    else:
        name = ctx.method or ctx.config.data_free_method
        precision = Precision(grid=grid, group_size=ctx.config.group_size)
        res = method(name).quantize(w, precision, ctx.config, device=ctx.device)
        q, w_hat, bits = res.quantized, res.w_hat, res.bits
    err = float(relative_error(w, w_hat))
    del w
    nbytes = writer.add_quantized(spec, q, w_hat, bits)
    del w_hat
    return _layer_row(spec, p, n, bits, err, nbytes)


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


def build_report(
    ctx: RunContext, specs: list[LayerSpec], plans: list[LayerPlan], written: Written
) -> Report:
    config = ctx.config
    model = ctx.model
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
            "id": model.id,
            "revision": model.revision,
            "kind": model.kind,
            "architecture": model.architecture,
            "model_type": model.hf_config.model_type,
        },
        versions=versions(),
        seed=config.seed,
        formats=list(config.formats),
        metrics=metrics,
    )


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
