"""MSE-optimal Gaussian grids shipped as package data (built by `higgs_engine.grid_build`).

get_grid(p, n) -> (n, p) float32 grid for the standard p-dimensional Gaussian;
grid_mse(p, n) -> its per-coordinate MSE (exact integrals for p = 1, a fine quadrature for p = 2),
read from the file's metadata. Nothing is computed at request time.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError

__all__ = ["GRIDS_PATH", "available_grids", "get_grid", "grid_mse"]

GRIDS_PATH = Path(__file__).with_name("data") / "grids.safetensors"


@lru_cache(maxsize=1)
def _load() -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    from safetensors import safe_open

    if not GRIDS_PATH.is_file():
        raise CorruptCheckpointError(
            f"grid file {GRIDS_PATH} is missing; run `python -m higgs_engine.grid_build`"
        )
    try:
        with safe_open(str(GRIDS_PATH), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            meta = f.metadata() or {}
        mse = {k: float(v) for k, v in json.loads(meta["mse"]).items()}
    except (OSError, KeyError, ValueError) as e:
        raise CorruptCheckpointError(f"grid file {GRIDS_PATH} cannot be read: {e}") from e
    return tensors, mse


def available_grids() -> list[tuple[int, int]]:
    """(p, n) pairs shipped in the package, sorted."""
    tensors, _ = _load()
    out = []
    for key in tensors:
        p, n = key.split("_")
        out.append((int(p[1:]), int(n[1:])))
    return sorted(out)


def _key(p: int, n: int) -> str:
    tensors, _ = _load()
    key = f"p{p}_n{n}"
    if key not in tensors:
        sizes = sorted(nn for pp, nn in available_grids() if pp == p)
        if not sizes:
            ps = sorted({pp for pp, _ in available_grids()})
            raise InvalidConfigError(f"p={p!r} has no shipped grids; choose p in {ps}")
        raise InvalidConfigError(
            f"n={n!r} is not a shipped grid size for p={p}; choose one of {sizes}"
        )
    return key


def get_grid(p: int, n: int) -> torch.Tensor:
    """The (n, p) float32 grid (a fresh copy the caller may modify)."""
    tensors, _ = _load()
    return tensors[_key(p, n)].clone()


def grid_mse(p: int, n: int) -> float:
    """Per-coordinate MSE of the (p, n) grid on the standard Gaussian."""
    _, mse = _load()
    return mse[_key(p, n)]
