"""The baselines HIGGS is compared with (benchmarks): round-to-nearest, NF4 (plain and with
double-quantized constants), standard GPTQ int4. None has a native encoding: each gives W_hat
and its exact bits per weight (higgs_engine.baselines, higgs_engine.gptq.gptq_rtn)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from higgs_engine.errors import InvalidConfigError
from higgs_engine.methods.base import CalibratedMethod, DataFreeMethod, Precision, Quantized

if TYPE_CHECKING:
    import torch

    from higgs_engine.planning.config import HiggsConfig

__all__ = ["GptqInt4Method", "Nf4DoubleQuantMethod", "Nf4Method", "RtnMethod"]


class RtnMethod(DataFreeMethod):
    """Asymmetric min-max round-to-nearest per row group (`rtn_quantize`): Precision.bits (or the
    grid's whole code bits), Precision.group_size (default 128)."""

    name: ClassVar[str] = "rtn"

    def quantize(
        self,
        w: torch.Tensor,
        precision: Precision,
        config: HiggsConfig | None = None,
        *,
        hessian: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> Quantized:
        from higgs_engine.baselines import rtn_quantize

        bits = precision.int_bits(self.name)
        if precision.group_size is None:
            w_hat, bpw = rtn_quantize(w, bits)
        else:
            w_hat, bpw = rtn_quantize(w, bits, group_size=precision.group_size)
        return Quantized(w_hat, float(bpw))


def _four_bits(method: str, precision: Precision) -> None:
    if precision.bits is not None and precision.bits != 4:
        raise InvalidConfigError(
            f"method {method!r} is 4-bit; bits={precision.bits} is not", field="bits"
        )


class Nf4Method(DataFreeMethod):
    """bitsandbytes' NF4 (`nf4_quantize`): absmax blocks of Precision.group_size (default 64)."""

    name: ClassVar[str] = "nf4"
    double_quant: ClassVar[bool] = False

    def quantize(
        self,
        w: torch.Tensor,
        precision: Precision,
        config: HiggsConfig | None = None,
        *,
        hessian: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> Quantized:
        from higgs_engine.baselines import nf4_quantize

        _four_bits(self.name, precision)
        if precision.group_size is None:
            w_hat, bpw = nf4_quantize(w, double_quant=self.double_quant)
        else:
            w_hat, bpw = nf4_quantize(
                w, block_size=precision.group_size, double_quant=self.double_quant
            )
        return Quantized(w_hat, float(bpw))


class Nf4DoubleQuantMethod(Nf4Method):
    """NF4 with the absmax constants double-quantized (bitsandbytes' bnb_4bit_use_double_quant)."""

    name: ClassVar[str] = "nf4-dq"
    double_quant: ClassVar[bool] = True


class GptqInt4Method(CalibratedMethod):
    """Standard GPTQ with a 4-bit asymmetric min-max grid (`gptq_rtn`), groups of
    Precision.group_size columns (default 128); matrices sharing an input are swept together."""

    name: ClassVar[str] = "gptq-int4"

    def quantize_many(
        self,
        ws: Sequence[torch.Tensor],
        precision: Precision,
        config: HiggsConfig | None = None,
        *,
        hessian: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> list[Quantized]:
        import torch

        from higgs_engine.gptq import gptq_rtn

        _four_bits(self.name, precision)
        h = self.need_hessian(hessian)
        if not ws:
            return []
        w = ws[0] if len(ws) == 1 else torch.cat(list(ws), 0)
        if precision.group_size is None:
            w_hat, bits = gptq_rtn(w, h, 4)
        else:
            w_hat, bits = gptq_rtn(w, h, 4, precision.group_size)
        out = []
        r0 = 0
        for x in ws:  # each matrix's rows of the stacked result
            r1 = r0 + int(x.shape[0])
            out.append(Quantized(w_hat[r0:r1].contiguous(), float(bits)))
            r0 = r1
        return out
