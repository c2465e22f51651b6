"""The `native` format: HIGGS codes and scales, loaded as HiggsLinear layers.

model.safetensors   per quantized layer `<module>.higgs.<tensor>` (packed codes, fp16 scales,
                    ... as QuantizedMatrix.to_tensors() names them), one `higgs.grid.p<P>.n<N>`
                    float32 (n, p) tensor per grid used, every other tensor under its own name
config.json         the source config + "quantization_config": {"quant_method": "higgs", ...}
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from higgs_engine.errors import InvalidConfigError
from higgs_engine.formats.base import FormatWriter, write_configs
from higgs_engine.planning.config import WriterFormat

if TYPE_CHECKING:
    import torch

    from higgs_engine.model_structure import LayerSpec
    from higgs_engine.quantize import QuantizedMatrix

__all__ = ["FORMAT_VERSION", "QUANT_METHOD", "NativeWriter", "grid_key", "quantization_config"]

QUANT_METHOD = "higgs"
FORMAT_VERSION = 1


def grid_key(p: int, n: int) -> str:
    """The native artifact's tensor name of grid (p, n)."""
    return f"higgs.grid.p{p}.n{n}"


def quantization_config(
    dtype: str,
    engine_config: dict[str, Any],
    grids: Iterable[tuple[int, int]],
    layers: dict[str, dict[str, Any]],
    kept: Iterable[str],
) -> dict[str, Any]:
    """The native config.json's "quantization_config" entry."""
    return {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "engine_config": engine_config,
        "grids": {f"p{p}n{n}": grid_key(p, n) for (p, n) in sorted(grids)},
        "layers": layers,
        "modules_to_not_convert": sorted(kept),
    }


class NativeWriter(FormatWriter):
    """Codes and scales of every quantized layer; the grids; quantization_config."""

    name: ClassVar[WriterFormat] = "native"
    carries_grids: ClassVar[bool] = True

    @classmethod
    def write_configs(
        cls, fmt_dir: Path, source_dir: Path, dtype: str, quant_config: dict[str, Any]
    ) -> None:
        write_configs(fmt_dir, source_dir, dtype, quant_config)

    def add_quantized(
        self, spec: LayerSpec, q: QuantizedMatrix | None, w_hat: torch.Tensor
    ) -> None:
        if q is None:
            raise InvalidConfigError(
                f"format {self.name!r} stores HIGGS codes, but layer {spec.name!r} was "
                "quantized by a method without a native encoding",
                field="formats",
            )
        for tname, t in q.to_tensors().items():
            self.add_plain(f"{spec.name}.higgs.{tname}", t)
