"""HIGGS quantization engine: Hadamard rotation + MSE-optimal Gaussian grids, data-free.

The public entry point is `run(QuantizeJob(...), out)` (higgs_engine.job: uniform, dynamic,
GGUF and compressed-tensors jobs, planned as a JobPlan and run part by part); `quantize_checkpoint` is one config over
the whole checkpoint in one run. They are imported lazily so that light consumers (the API
validating a config) do not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from higgs_engine.errors import HiggsError
from higgs_engine.planning.config import HiggsConfig, LayerOverride
from higgs_engine.report import LayerReport, Report

__version__ = "0.1.0"

if TYPE_CHECKING:
    from higgs_engine.job import CtOptions, ProfileSource, QuantizeJob, run
    from higgs_engine.pipeline import quantize_checkpoint


def __getattr__(name: str) -> Any:
    if name == "quantize_checkpoint":
        from higgs_engine.pipeline import quantize_checkpoint

        return quantize_checkpoint
    if name in ("CtOptions", "ProfileSource", "QuantizeJob", "run"):
        from higgs_engine import job

        return getattr(job, name)
    raise AttributeError(name)


__all__ = [
    "CtOptions",
    "HiggsConfig",
    "HiggsError",
    "LayerOverride",
    "LayerReport",
    "ProfileSource",
    "QuantizeJob",
    "Report",
    "quantize_checkpoint",
    "run",
]
