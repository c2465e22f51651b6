"""Calibrated compressed-tensors: every linear layer inside the transformer blocks quantized by
GPTQ in its assigned scheme (higgs_engine.ct.gptq) with the Hessian of its inputs, from the
block-by-block pass over the calibration text (higgs_engine.calibration, stage "calibrating"),
so later blocks see the quantization error of earlier ones. Columns are swept in activation
order, the group scales fixed first (ACT_ORDER; docs/algorithm.md section 8 has the figures).
Layers the pass cannot reach and layers kept 16-bit are left to the writer (data-free or
copied).

The result is the writer's input (`PrecomputedLayer`: the library's compressed tensors and t^2
against the source weight), so a calibrated checkpoint has exactly the layout, schemes and size
of the data-free one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from higgs_engine.ct.writer import CtAssignment, PrecomputedLayer
from higgs_engine.progress import ProgressCallback

if TYPE_CHECKING:
    import torch

    from higgs_engine.calibration import Calibration
    from higgs_engine.model_structure import LayerSpec
    from higgs_engine.sources import ResolvedModel

__all__ = ["ACT_ORDER", "calibrated_layers"]

# Sweep each layer's columns by falling input power, every group's scale fixed first (lower
# KL than the layer's column order on both SmolLM2 and MiniLM: docs/algorithm.md section 8).
ACT_ORDER = True


def calibrated_layers(
    model: ResolvedModel,
    assignment: CtAssignment,
    calibration: Calibration,
    dtype: str,
    progress: ProgressCallback | None = None,
) -> tuple[dict[str, PrecomputedLayer], dict[str, Any]]:
    """GPTQ of every quantized block layer of `model` in its scheme of `assignment`, scales in
    `dtype`: ({layer name: its stored tensors and t^2}, the report's calibration entry)."""
    from higgs_engine.calibration import gptq_entry, run_calibrated
    from higgs_engine.ct.gptq import gptq_layer
    from higgs_engine.ct.quantizer import dequantize, relative_error
    from higgs_engine.ct.writer import compress_layer, ct_layers
    from higgs_engine.formats.base import torch_dtype
    from higgs_engine.safetensors_stream import CheckpointReader

    tdtype = torch_dtype(dtype)
    specs = [
        s
        for s in ct_layers(model.path)
        if not s.transposed and not assignment.scheme_of(s.name).keep
    ]
    out: dict[str, PrecomputedLayer] = {}

    def quantize(
        group: list[LayerSpec], ws: list[torch.Tensor], hessian: torch.Tensor
    ) -> list[torch.Tensor]:
        w_hats = []
        for spec, w in zip(group, ws, strict=True):
            q = gptq_layer(w, hessian, assignment.scheme_of(spec.name), tdtype, act_order=ACT_ORDER)
            w_hat = dequantize(q)
            out[spec.name] = PrecomputedLayer(compress_layer(q, tdtype), relative_error(w, w_hat))
            w_hats.append(w_hat.float())
        return w_hats

    with CheckpointReader(model.path) as reader:
        outside = run_calibrated(model, reader, specs, calibration, quantize, progress)
    order = "activation" if ACT_ORDER else "layer"
    return out, gptq_entry(calibration, len(out), outside, order=order)
