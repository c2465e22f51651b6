"""The whole-checkpoint stage of higgs_engine.job.run (the entry point the CLI and the service
call): `quantize_whole` quantizes every tensor of a resolved model into a directory;
`quantize_checkpoint` is the same stage on its own (resolve, then quantize into an atomic
output), for a library caller with one config. A sharded source run by the entry point goes
part by part instead (higgs_engine.parts, driven by higgs_engine.job).

Streaming: tensors are read one at a time from the source safetensors, quantized (or cast to
16 bits) and appended to the output files, so peak memory is bounded by the largest tensor
(plus its quantization temporaries), not by the model.

Atomic output: everything is written into a temporary sibling of `out_dir` and renamed at the
end; on any error or cancellation the temporary directory is removed and `out_dir` is left as
it was (absent). report.json is written once, into the temporary directory, after the caller's
`annotate` (higgs_engine.job.run's dynamic annotations, the service's metrics) ran on it.

The layer plan, the tensor streaming and the report are the run core (higgs_engine.run_core),
shared with the part-by-part runs of higgs_engine.parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from higgs_engine.model_structure import LayerSpec
from higgs_engine.output import atomic_output
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.progress import ProgressCallback, report
from higgs_engine.report import Report
from higgs_engine.run_core import (
    LayerPlan,
    RunContext,
    Written,
    build_report,
    plan_layers,
    stream_tensors,
)
from higgs_engine.safetensors_stream import CheckpointReader
from higgs_engine.sources import ResolvedModel, resolve_model

if TYPE_CHECKING:
    import torch

    from higgs_engine.calibration import Calibration
    from higgs_engine.quantize import QuantizedMatrix


# ---------------------------------------------------------------------------------------------
# Calibration: GPTQ with HIGGS grids over the planned layers
# ---------------------------------------------------------------------------------------------


def calibrate_layers(
    ctx: RunContext,
    reader: CheckpointReader,
    todo: list[LayerPlan],
    calibration: Calibration,
) -> tuple[dict[str, QuantizedMatrix], dict[str, object]]:
    """Calibrated HIGGS of every planned layer: GPTQ with the layer's HIGGS grid and the Hessian
    of its inputs from the block-by-block pass. Returns ({name: q}, the report's calibration
    entry). Layers the pass cannot reach (outside the transformer blocks) are left out of the
    dict: the pipeline quantizes them without data and the entry lists them."""
    from higgs_engine.calibration import gptq_entry, run_calibrated
    from higgs_engine.methods import METHODS, Precision

    config = ctx.config
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
            res = METHODS["higgs-gptq"].quantize_many(
                [ws[i] for i in idx], Precision(grid=grid), config, hessian=hessian
            )
            for i, r in zip(idx, res, strict=True):
                assert r.quantized is not None
                out[group[i].name] = r.quantized
                w_hats[group[i].name] = r.w_hat
        return [w_hats[s.name] for s in group]

    outside = run_calibrated(
        ctx.model, reader, [pl.spec for pl in todo], calibration, quantize, ctx.progress
    )
    return out, gptq_entry(calibration, len(out), outside)


# ---------------------------------------------------------------------------------------------
# The whole checkpoint
# ---------------------------------------------------------------------------------------------


def quantize_checkpoint(
    source: str | Path | ResolvedModel,
    out_dir: Path,
    config: HiggsConfig,
    progress: ProgressCallback | None = None,
    *,
    device: str | None = None,
    calibration: Calibration | None = None,
    overwrite: bool = False,
    annotate: Callable[[Report, Path], None] | None = None,
) -> Report:
    """Quantize `source` (local dir, .gguf file, Hub id, or a model resolved already) into
    `out_dir` as one run over the whole checkpoint and return the Report.

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
    annotate(report, staged_dir): what the caller adds to the report, given the staged output
    directory (its artifacts complete), before report.json is written there (once) and the
    directory is renamed to `out_dir`.
    """
    from higgs_engine.device import resolve_device
    from higgs_engine.output import check_out_dir

    check_out_dir(Path(out_dir), overwrite)  # before any work: an existing output is refused
    t0 = time.perf_counter()
    report(progress, "resolving", 0, 1)
    model = resolve_model(source)
    report(progress, "resolving", 1, 1)
    dev = resolve_device(device or "cpu")
    with atomic_output(out_dir, overwrite) as tmp:
        ctx = RunContext(model=model, tmp=tmp, config=config, progress=progress, device=dev)
        ctx.timings["resolving"] = time.perf_counter() - t0
        return quantize_whole(ctx, calibration, annotate, started=t0)


def quantize_whole(
    ctx: RunContext,
    calibration: Calibration | None = None,
    annotate: Callable[[Report, Path], None] | None = None,
    started: float | None = None,
) -> Report:
    """Every tensor of ctx.model, read in file order, quantized (calibrated with `calibration`)
    or cast into ctx.tmp (created here); then `annotate` and the one write of report.json.
    `started`: when the run began (perf_counter), for timings["total"]."""
    t_start = time.perf_counter() if started is None else started
    t0 = time.perf_counter()
    report(ctx.progress, "loading", 0, 1)
    with CheckpointReader(ctx.model.path) as reader:
        specs = ctx.model.specs(ctx.config.scope)
        plans = plan_layers(specs, ctx.config)
        report(ctx.progress, "loading", 1, 1)
        ctx.timings["loading"] = time.perf_counter() - t0
        written = _write_artifacts(ctx, calibration, reader, plans)
    ctx.timings["total"] = time.perf_counter() - t_start
    rep = build_report(ctx, specs, plans, written)
    if annotate is not None:
        annotate(rep, ctx.tmp)
    rep.save(ctx.tmp / "report.json")
    report(ctx.progress, "packaging", 1, 1)
    return rep


def _write_artifacts(
    ctx: RunContext,
    calibration: Calibration | None,
    reader: CheckpointReader,
    plans: list[LayerPlan],
) -> Written:
    """Stages calibrating (with `calibration`), quantizing and packaging into ctx.tmp."""
    from higgs_engine.artifacts import ArtifactWriter

    t0 = time.perf_counter()
    todo = [pl for pl in plans if pl.grid is not None]
    report(ctx.progress, "quantizing", 0, len(todo))
    ctx.tmp.mkdir()
    config = ctx.config
    writer = ArtifactWriter(ctx.tmp, config.formats, config.dtype, ctx.model.path, config.to_dict())
    try:
        calibrated: dict[str, QuantizedMatrix] = {}
        cal_info: dict[str, object] | None = None
        if calibration is not None:
            t_cal = time.perf_counter()
            calibrated, cal_info = calibrate_layers(ctx, reader, todo, calibration)
            ctx.timings["calibrating"] = time.perf_counter() - t_cal
        rows = stream_tensors(ctx, reader, plans, writer, calibrated, len(todo))
        ctx.timings["quantizing"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        report(ctx.progress, "packaging", 0, 1)
        files = writer.finish()
    except BaseException:
        writer.abort()
        raise
    written = Written(
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
