"""HIGGS: data-free ("higgs", what every run quantizes a layer with) and calibrated
("higgs-gptq": GPTQ with the HIGGS grid, the layers of one input swept together). Both give the
QuantizedMatrix the native format stores; the grid, scale group, rotation block, signs and
scale rule come from the HiggsConfig (the grid and scale group from the Precision when it names
them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from higgs_engine.methods.base import CalibratedMethod, DataFreeMethod, Quantized, Precision

if TYPE_CHECKING:
    import torch

    from higgs_engine.planning.config import HiggsConfig

__all__ = ["HiggsGptqMethod", "HiggsMethod"]


def _grid(precision: Precision, config: HiggsConfig) -> tuple[int, int]:
    return precision.grid if precision.grid is not None else (config.p, config.n)


def _group_size(precision: Precision, config: HiggsConfig) -> int:
    return precision.group_size if precision.group_size is not None else config.group_size


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

        cfg = self.need_config(config)
        p, n = _grid(precision, cfg)
        q, w_hat = quantize_matrix_full(
            w,
            p,
            n,
            group_size=_group_size(precision, cfg),
            rotation_block=cfg.rotation_block,
            sign_seed=cfg.sign_seed,
            device=device,
            scale_rule=cfg.scale_rule,
        )
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

        cfg = self.need_config(config)
        h = self.need_hessian(hessian)
        p, n = _grid(precision, cfg)
        res = gptq_higgs_many(
            list(ws),
            h,
            p,
            n,
            group_size=_group_size(precision, cfg),
            rotation_block=cfg.rotation_block,
            sign_seed=cfg.sign_seed,
            scale_rule=cfg.scale_rule,
        )
        return [Quantized(w_hat, float(q.bits_per_weight()), q) for q, w_hat in res]
