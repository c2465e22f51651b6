"""The allocator's options: a grid (p, n) or "keep 16-bit" per layer, and the one menu of them.

Pure Python (no numpy), so the API checks targets and builds menus without loading the
allocator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.config import SUPPORTED_GRIDS, check_grid, code_bits

__all__ = ["KEEP_16", "Option", "default_options", "option_menu"]

KEEP_16 = 0  # Option.p for "keep the layer in 16 bits"


@dataclass(frozen=True, order=True)
class Option:
    """One choice for a layer: a grid (p, n), or p=0 for keeping the layer in 16 bits."""

    p: int
    n: int

    def __post_init__(self) -> None:
        if self.p != KEEP_16:
            check_grid(self.p, self.n)

    @property
    def keep(self) -> bool:
        return self.p == KEEP_16

    @property
    def label(self) -> str:
        return "fp16" if self.keep else f"p{self.p}n{self.n}"


def default_options() -> tuple[Option, ...]:
    """Every grid the engine ships, plus "keep 16-bit", cheapest code bits first."""
    grids = [Option(p, n) for p, ns in SUPPORTED_GRIDS.items() for n in ns]
    # Sorted by code bits, then p=2 first (lower MSE at equal bits), so ties in the DP go to it.
    grids.sort(key=lambda o: (code_bits(o.p, o.n), -o.p, o.n))
    return (*grids, Option(KEEP_16, 0))


def option_menu(p: int | None = None, max_code_bits: float | None = None) -> tuple[Option, ...]:
    """The allocator's menu: every shipped grid (only those of dimension `p`, only those of at
    most `max_code_bits` code bits, when given) plus "keep 16-bit", in default_options' order,
    which decides ties. The one menu the CLI, the API's plans and the worker's jobs use."""
    if p is not None and p not in SUPPORTED_GRIDS:
        raise InvalidConfigError(
            f"p={p} is not supported; choose one of {sorted(SUPPORTED_GRIDS)}", field="p"
        )
    if max_code_bits is not None and (not math.isfinite(max_code_bits) or max_code_bits < 1):
        raise InvalidConfigError(
            f"max_code_bits={max_code_bits} must be at least 1 (the smallest grid)",
            field="max_code_bits",
        )
    return tuple(
        o
        for o in default_options()
        if o.keep
        or (
            (p is None or o.p == p)
            and (max_code_bits is None or code_bits(o.p, o.n) <= max_code_bits + 1e-9)
        )
    )
