"""The Method interface: one quantization method, one weight matrix (or one group of matrices
sharing an input) at a time.

A method takes a layer's float32 (out, in) weight, what the layer is quantized to (`Precision`: a
HIGGS grid and/or an integer width, a scale group) and the run's HiggsConfig, and returns
`Quantized`: W_hat, the bits per weight it costs, and, when the method has a native encoding,
the QuantizedMatrix the native artifact stores. A method that needs calibration data
(`needs_calibration`) also takes the Hessian 2 X^T X / tokens of the layers' unrotated inputs
and quantizes every matrix of a group sharing it at once (`quantize_many`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from higgs_engine.errors import InvalidConfigError

if TYPE_CHECKING:
    import torch

    from higgs_engine.planning.config import HiggsConfig
    from higgs_engine.quantize import QuantizedMatrix

__all__ = ["CalibratedMethod", "DataFreeMethod", "Method", "Precision", "Quantized"]


@dataclass(frozen=True)
class Precision:
    """What one layer is quantized to.

    grid: a HIGGS grid (p, n) (HIGGS methods: None = the config's p, n); bits: an integer
    width (the integer-grid baselines; None = the grid's code bits log2(n) / p when whole);
    group_size: the scale group or block (None = the method's default; HIGGS: the config's).
    """

    grid: tuple[int, int] | None = None
    bits: int | None = None
    group_size: int | None = None

    def int_bits(self, method: str) -> int:
        """The integer width: `bits`, else the grid's code bits when a whole number."""
        if self.bits is not None:
            return self.bits
        if self.grid is not None:
            p, n = self.grid
            b = math.log2(n) / p if n > 0 and p > 0 else 0.0
            if b >= 1 and b.is_integer():
                return int(b)
        raise InvalidConfigError(
            f"method {method!r} needs an integer bit width; {self} gives none",
            field="bits",
        )


@dataclass(frozen=True)
class Quantized:
    """One quantized matrix: W_hat (out, in) float32, bits per weight (the grid of a HIGGS
    matrix counted apart, as the artifacts count it), and the native encoding if any."""

    w_hat: torch.Tensor
    bits: float
    quantized: QuantizedMatrix | None = None


class Method(ABC):
    """A quantization method of the registry higgs_engine.methods.METHODS.

    `name` is its registry key; `needs_calibration`: it needs the Hessian of the layer inputs
    (`hessian=`), else it is data-free and ignores one; `native`: its results carry the
    QuantizedMatrix the native format stores.
    """

    name: ClassVar[str]
    needs_calibration: ClassVar[bool] = False
    native: ClassVar[bool] = False

    @abstractmethod
    def quantize(
        self,
        w: torch.Tensor,
        precision: Precision,
        config: HiggsConfig | None = None,
        *,
        hessian: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> Quantized:
        """Quantize one (out, in) weight matrix."""

    @abstractmethod
    def quantize_many(
        self,
        ws: Sequence[torch.Tensor],
        precision: Precision,
        config: HiggsConfig | None = None,
        *,
        hessian: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> list[Quantized]:
        """Quantize matrices that share one input (and, calibrated, its Hessian), in order."""

    def need_config(self, config: HiggsConfig | None) -> HiggsConfig:
        if config is None:
            raise InvalidConfigError(f"method {self.name!r} needs a HiggsConfig")
        return config

    def need_hessian(self, hessian: torch.Tensor | None) -> torch.Tensor:
        if hessian is None:
            raise InvalidConfigError(
                f"method {self.name!r} needs calibration data (the Hessian of its inputs)"
            )
        return hessian


class DataFreeMethod(Method):
    """A method that quantizes each matrix on its own: `quantize_many` is `quantize` per matrix."""

    def quantize_many(
        self,
        ws: Sequence[torch.Tensor],
        precision: Precision,
        config: HiggsConfig | None = None,
        *,
        hessian: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> list[Quantized]:
        return [self.quantize(w, precision, config, device=device) for w in ws]


class CalibratedMethod(Method):
    """A method that needs the inputs' Hessian: `quantize` is `quantize_many` of one matrix."""

    needs_calibration: ClassVar[bool] = True

    def quantize(
        self,
        w: torch.Tensor,
        precision: Precision,
        config: HiggsConfig | None = None,
        *,
        hessian: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> Quantized:
        return self.quantize_many([w], precision, config, hessian=hessian, device=device)[0]
