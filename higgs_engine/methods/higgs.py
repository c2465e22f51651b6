"""HIGGS: data-free ("higgs", what every run quantizes a layer with) and calibrated
("higgs-gptq": GPTQ with the HIGGS grid, the layers of one input swept together). Both give the
QuantizedMatrix the native format stores; the grid, scale group, rotation block, signs and
scale rule come from the HiggsConfig (the grid and scale group from the Precision when it names
them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

from higgs_engine.methods.base import CalibratedMethod, DataFreeMethod, Precision, Quantized

if TYPE_CHECKING:
    import torch

    from higgs_engine.planning.config import HiggsConfig, MatrixSpec

__all__ = ["HiggsGptqMethod", "HiggsMethod"]


def _spec(precision: Precision, config: HiggsConfig) -> MatrixSpec:
    """The config's MatrixSpec, with the grid and scale group of `precision` when it names
    them."""
    spec = config.matrix_spec(precision.grid)
    if precision.group_size is None:
        return spec
    return replace(spec, group_size=precision.group_size)


class HiggsMethod(DataFreeMethod):
    """Data-free HIGGS (higgs_engine.quantize.quantize_matrix_full)."""

    name: ClassVar[str] = "higgs"
    native: ClassVar[bool] = True

    def quantize(
        self,
        w: torch.Tensor,
        precision: Precision,
        config: HiggsConfig | None = None,
        *,
        hessian: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> Quantized:
        from higgs_engine.quantize import quantize_matrix_full

        spec = _spec(precision, self.need_config(config))
        q, w_hat = quantize_matrix_full(w, spec, device=device)
        assert w_hat is not None
        return Quantized(w_hat, float(q.bits_per_weight()), q)


class HiggsGptqMethod(CalibratedMethod):
    """Calibrated HIGGS (higgs_engine.gptq.gptq_higgs_many): matrices sharing an input are
    stacked and swept once with their Hessian."""

    name: ClassVar[str] = "higgs-gptq"
    native: ClassVar[bool] = True

    def quantize_many(
        self,
        ws: Sequence[torch.Tensor],
        precision: Precision,
        config: HiggsConfig | None = None,
        *,
        hessian: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> list[Quantized]:
        from higgs_engine.gptq import gptq_higgs_many

        spec = _spec(precision, self.need_config(config))
        res = gptq_higgs_many(list(ws), self.need_hessian(hessian), spec)
        return [Quantized(w_hat, float(q.bits_per_weight()), q) for q, w_hat in res]
