"""Quantization methods: one Method per way of quantizing a weight matrix, and the registry
`METHODS` of them.

    base       the Method interface (name, whether it needs calibration data, whether it has a
               native encoding; quantize one matrix / a group sharing an input), Precision (the
               layer's grid / bits / scale group) and Quantized (W_hat, bits, the encoding)
    higgs      "higgs" (data-free HIGGS: every run's per-layer quantization) and "higgs-gptq"
               (calibrated HIGGS: GPTQ with the HIGGS grid, higgs_engine.pipeline.calibrate_layers)
    baselines  "rtn", "nf4", "nf4-dq", "gptq-int4": the benchmarks' baselines

The run core quantizes each planned layer with METHODS[RunContext.method] ("higgs" unless a
run says otherwise); a method without a native encoding can only write formats that need none
(`dequantized`). Adding a method: a module here with a DataFreeMethod or CalibratedMethod
subclass, and one line in `METHODS`.
"""

from __future__ import annotations

from higgs_engine.errors import InvalidConfigError
from higgs_engine.methods.base import (
    CalibratedMethod,
    DataFreeMethod,
    Method,
    Precision,
    Quantized,
)
from higgs_engine.methods.baselines import (
    GptqInt4Method,
    Nf4DoubleQuantMethod,
    Nf4Method,
    RtnMethod,
)
from higgs_engine.methods.higgs import HiggsGptqMethod, HiggsMethod

__all__ = [
    "METHODS",
    "CalibratedMethod",
    "DataFreeMethod",
    "Method",
    "Precision",
    "Quantized",
    "method",
]

# name -> the method (stateless instances).
METHODS: dict[str, Method] = {
    "higgs": HiggsMethod(),
    "higgs-gptq": HiggsGptqMethod(),
    "rtn": RtnMethod(),
    "nf4": Nf4Method(),
    "nf4-dq": Nf4DoubleQuantMethod(),
    "gptq-int4": GptqInt4Method(),
}


def method(name: str) -> Method:
    """The registered method `name` (InvalidConfigError naming it when unknown)."""
    try:
        return METHODS[name]
    except KeyError:
        raise InvalidConfigError(f"method {name!r} is not one of {sorted(METHODS)}") from None
