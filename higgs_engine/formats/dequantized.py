"""The `dequantized` format: an ordinary 16-bit checkpoint of the quantized weights, loaded by
stock transformers (W_hat under each layer's own weight name, in the run's dtype)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from higgs_engine.formats.base import FormatWriter
from higgs_engine.planning.config import WriterFormat

if TYPE_CHECKING:
    import torch

    from higgs_engine.model_structure import LayerSpec
    from higgs_engine.quantize import QuantizedMatrix

__all__ = ["DequantizedWriter"]


class DequantizedWriter(FormatWriter):
    """W_hat of every quantized layer, as the source stores it (Conv1D: transposed)."""

    name: ClassVar[WriterFormat] = "dequantized"

    def add_quantized(
        self, spec: LayerSpec, q: QuantizedMatrix | None, w_hat: torch.Tensor
    ) -> None:
        w = w_hat.t() if spec.transposed else w_hat  # Conv1D stores (in, out)
        self.add_plain(spec.key, self.cast(w.contiguous()))
