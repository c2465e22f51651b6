"""Where the engine computes: "auto" (CUDA when usable, else the CPU), "cpu", "cuda[:N]".

The results do not depend on the device except at float32 near-ties of the nearest-point
search (see higgs_engine.nearest), so the device is a run option, not part of HiggsConfig.
"""

from __future__ import annotations

import torch

from higgs_engine.errors import InvalidConfigError

__all__ = ["DEVICE_CHOICES", "resolve_device"]

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """The torch device for `spec`, refusing one this machine cannot use (named in the error)."""
    if spec is None or spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidConfigError(
            f"device {spec!r} is not one of {', '.join(DEVICE_CHOICES)}"
        ) from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise InvalidConfigError(f"device {spec!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if not torch.cuda.is_available():
        raise InvalidConfigError(
            f"device {spec!r} asked for, but CUDA is not available to torch {torch.__version__}"
        )
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidConfigError(
            f"device {spec!r} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return dev
