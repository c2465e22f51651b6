"""Per-coordinate MSE of the shipped grids, read from the grid file's header (no torch).

higgs_engine.grids loads the grids themselves with torch; the allocator only needs their MSEs,
which grid_build stores as JSON in the safetensors metadata. A safetensors file starts with an
8-byte little-endian header length and a JSON header whose "__metadata__" holds them, so they
can be read with json alone (the API process, which has no torch, plans with them).
"""

from __future__ import annotations

import json
import struct
from functools import lru_cache

from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError

__all__ = ["grid_mse", "grid_mse_table"]

_MAX_HEADER = 1 << 24


@lru_cache(maxsize=1)
def grid_mse_table() -> dict[tuple[int, int], float]:
    """{(p, n): per-coordinate MSE} of every grid in higgs_engine/data/grids.safetensors."""
    from pathlib import Path

    path = Path(__file__).parents[1] / "data" / "grids.safetensors"
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise ValueError(f"header of {size} bytes is implausible")
            header = json.loads(f.read(size))
        raw = json.loads(header["__metadata__"]["mse"])
        table: dict[tuple[int, int], float] = {}
        for key, value in raw.items():
            p, n = key.split("_")
            table[(int(p[1:]), int(n[1:]))] = float(value)
    except (OSError, KeyError, ValueError, struct.error) as e:
        raise CorruptCheckpointError(f"grid file {path} cannot be read: {e}") from e
    return table


def grid_mse(p: int, n: int) -> float:
    """Per-coordinate MSE of the (p, n) grid on the standard Gaussian (same figure as
    higgs_engine.grids.grid_mse)."""
    table = grid_mse_table()
    if (p, n) not in table:
        raise InvalidConfigError(
            f"(p={p!r}, n={n!r}) is not a shipped grid; choose one of {sorted(table)}"
        )
    return table[(p, n)]
