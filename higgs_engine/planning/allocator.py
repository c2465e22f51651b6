"""Dynamic HIGGS: choose one grid (or 16 bits) per layer by a multiple-choice knapsack.

Per layer l and option j: cost c_lj = bits the layer occupies with option j (codes, fp16 scales
of its real block layout, the fp16 grid), error e_lj = alpha_l * mse_lj (the linearity theorem,
docs/algorithm.md section 4). Minimise sum e subject to sum c <= budget.

Discretisation. One cost unit is `resolution * total_numel` bits (1e-4 bits per weight by
default). Costs are measured from each layer's cheapest option and rounded UP to whole units,
so an allocation that fits the discretised budget always fits the real one; the DP is exact for
the discretised costs, and it can lose at most one unit per layer against the continuous
optimum. dp[l][b] = least error of layers 0..l using at most b units; the table of back-pointers
(one small int per layer and budget unit) gives the allocation for EVERY budget, so the primal
(budget -> best error), the dual (error bound -> smallest budget) and the Pareto curve all come
from one table.

Determinism: ties go to the lowest option index (numpy argmin returns the first minimum), and
the arithmetic is a fixed sequence of float64 additions, so the same input gives the same
allocation byte for byte.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from higgs_engine.errors import InfeasibleTargetError, InvalidConfigError
from higgs_engine.planning.config import LayerOverride
from higgs_engine.planning.layout import block_layout
from higgs_engine.planning.options import KEEP_16, Option, default_options, option_menu

__all__ = [
    "FP16_BITS",
    "KEEP_16",
    "AllocLayer",
    "Allocation",
    "DPTable",
    "Option",
    "ParetoPoint",
    "Problem",
    "allocate",
    "brute_force",
    "build_problem",
    "default_options",
    "layer_bits",
    "option_menu",
    "solve",
]

_GRID_COORD_BITS = 32  # the native artifact stores each grid once, in float32
_NEVER = 2**62  # cost units of an option a layer may not use
FP16_BITS = 16  # bits per weight of a layer kept at 16 bits


def layer_bits(
    option: Option,
    out_features: int,
    in_features: int,
    group_size: int = 256,
    rotation_block: int = 1024,
    keep_bits: int = FP16_BITS,
) -> float:
    """Bits one (out x in) layer occupies with `option`, its own overheads included.

    Codes: log2(n) bits per p-tuple. Scales: one fp16 per scale group of each rotation block of
    each row (a block shorter than the group is one group), e.g. in=576, g=256, blocks 512+64 ->
    3 scales per row. Kept layers: `keep_bits` per weight (the artifact's 16-bit dtype). The grid
    itself is stored once per artifact, not per layer: see `grid_bits`. Matches
    QuantizedMatrix.to_tensors() byte for byte (tested).
    """
    if out_features <= 0 or in_features <= 0:
        raise InvalidConfigError(f"layer shape ({out_features}, {in_features}) must be positive")
    numel = out_features * in_features
    if option.keep:
        return float(keep_bits * numel)
    layout = block_layout(in_features, rotation_block)
    scales_per_row = sum(max(1, h // group_size) for h in layout)
    # codes: log2(n) bits per p-tuple, bit-packed into whole bytes per layer
    code = 8 * math.ceil(numel // option.p * int(math.log2(option.n)) / 8)
    return code + FP16_BITS * out_features * scales_per_row


def grid_bits(option: Option) -> float:
    """Bits of the grid table (n points of p coordinates), stored once per artifact, in float32
    as the native artifact stores it."""
    return 0.0 if option.keep else float(_GRID_COORD_BITS * option.n * option.p)


@dataclass(frozen=True)
class AllocLayer:
    """A quantizable layer as the allocator sees it: its shape and its sensitivity alpha
    (checkpoint.LayerSpec is the layer as the checkpoint holds it: tensor keys, layout)."""

    name: str
    out_features: int
    in_features: int
    alpha: float

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features


@dataclass(frozen=True)
class Problem:
    """An allocation instance: costs (bits) and errors, one row per layer, one column per option."""

    names: tuple[str, ...]
    numel: np.ndarray  # (L,) int64
    options: tuple[Option, ...]
    cost_bits: np.ndarray  # (L, J) float64, bits of the layer with each option (inf: not allowed)
    error: np.ndarray  # (L, J) float64, predicted metric increase alpha_l * mse_lj
    grid_cost: (
        np.ndarray
    )  # (J,) float64, bits of each option's grid, paid once if any layer uses it

    @property
    def total_numel(self) -> int:
        return int(self.numel.sum())

    @property
    def allowed(self) -> np.ndarray:
        allowed: np.ndarray = np.isfinite(self.cost_bits)  # (L, J)
        return allowed

    def total_bits(self, choice: Sequence[int]) -> float:
        """Exact size of an assignment: layer costs plus each distinct grid once."""
        ch = np.asarray(choice, dtype=np.int64)
        layers = float(self.cost_bits[np.arange(len(ch)), ch].sum())
        return layers + float(self.grid_cost[np.unique(ch)].sum())

    def min_avg_bits(self) -> float:
        """Every layer on its cheapest option (and those options' grids)."""
        return self.total_bits(np.argmin(self.cost_bits, axis=1).tolist()) / self.total_numel

    def max_avg_bits(self) -> float:
        """Every layer on its costliest option, plus every grid: an upper bound on any assignment."""
        costly = np.where(self.allowed, self.cost_bits, -np.inf).max(axis=1).sum()
        return float((costly + self.grid_cost.sum()) / self.total_numel)


def build_problem(
    layers: Sequence[AllocLayer],
    options: Sequence[Option] | None = None,
    *,
    group_size: int = 256,
    rotation_block: int = 1024,
    mse: Callable[[Option], float] | None = None,
    measured_mse: np.ndarray | None = None,
    keep_bits: int = FP16_BITS,
) -> Problem:
    """Costs and errors of every (layer, option).

    `mse(option)` is the per-coordinate MSE of a grid (default: higgs_engine.grids.grid_mse);
    `measured_mse` (L, J), when given, replaces it with each layer's measured t^2 per option.
    A grid with p not dividing a layer's in_features is not allowed for that layer (the
    quantizer would keep it in 16 bits).
    """
    if not layers:
        raise InvalidConfigError("no layers to allocate: the model has no quantizable layer")
    opts = tuple(options) if options is not None else default_options()
    if not opts:
        raise InvalidConfigError("the option menu is empty")
    if len(set(opts)) != len(opts):
        raise InvalidConfigError(f"duplicate options in {[o.label for o in opts]}")
    names = tuple(layer.name for layer in layers)
    if len(set(names)) != len(names):
        raise InvalidConfigError("duplicate layer names")
    alphas = np.array([layer.alpha for layer in layers], dtype=np.float64)
    bad = [layer.name for layer in layers if not math.isfinite(layer.alpha) or layer.alpha < 0]
    if bad:
        raise InvalidConfigError(f"alpha must be finite and >= 0; bad for layers {bad[:5]}")
    cost = np.array(
        [
            [
                layer_bits(
                    o, layer.out_features, layer.in_features, group_size, rotation_block, keep_bits
                )
                if o.keep or layer.in_features % o.p == 0
                else np.inf
                for o in opts
            ]
            for layer in layers
        ],
        dtype=np.float64,
    )
    if not np.all(np.isfinite(cost).any(axis=1)):
        raise InvalidConfigError(
            "some layer has no allowed option; add Option(0, 0) (keep 16-bit) to the menu"
        )
    if measured_mse is not None:
        m = np.asarray(measured_mse, dtype=np.float64)
        if m.shape != cost.shape:
            raise InvalidConfigError(f"measured_mse has shape {m.shape}, expected {cost.shape}")
        if not np.all(np.isfinite(m)) or np.any(m < 0):
            raise InvalidConfigError("measured_mse must be finite and >= 0")
    else:
        if mse is None:
            from higgs_engine.planning.grid_table import grid_mse  # same figures, no torch

            def mse(o: Option) -> float:
                return grid_mse(o.p, o.n)

        row = np.array([0.0 if o.keep else float(mse(o)) for o in opts], dtype=np.float64)
        m = np.broadcast_to(row, cost.shape)
    error = np.where(np.isfinite(cost), alphas[:, None] * m, np.inf)
    numel = np.array([layer.numel for layer in layers], dtype=np.int64)
    grids = np.array([grid_bits(o) for o in opts], dtype=np.float64)
    return Problem(names, numel, opts, cost, np.ascontiguousarray(error), grids)


@dataclass(frozen=True)
class Allocation:
    """One option per layer, with its exact size and predicted metric increase."""

    names: tuple[str, ...]
    options: tuple[Option, ...]  # the chosen option of each layer
    choice: tuple[int, ...]  # index into the problem's option menu
    total_bits: float
    avg_bits: float  # over the allocated layers, every overhead counted
    predicted: float  # sum of alpha_l * mse of the chosen options

    def overrides(self) -> tuple[LayerOverride, ...]:
        return tuple(
            LayerOverride(name, o.p, o.n) for name, o in zip(self.names, self.options, strict=True)
        )

    def histogram(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.options:
            out[o.label] = out.get(o.label, 0) + 1
        return dict(sorted(out.items()))


@dataclass(frozen=True)
class ParetoPoint:
    avg_bits: float
    predicted: float


def _allocation(problem: Problem, choice: Sequence[int]) -> Allocation:
    idx = np.arange(len(problem.names))
    ch = np.asarray(choice, dtype=np.int64)
    total = problem.total_bits(ch.tolist())
    # Summed in layer order so the figure is reproducible to the last bit.
    predicted = float(math.fsum(problem.error[idx, ch].tolist()))
    return Allocation(
        names=problem.names,
        options=tuple(problem.options[j] for j in ch.tolist()),
        choice=tuple(int(j) for j in ch.tolist()),
        total_bits=total,
        avg_bits=total / problem.total_numel,
        predicted=predicted,
    )


class DPTable:
    """The filled DP table of a problem up to some budget; answers every budget below it."""

    def __init__(
        self, problem: Problem, max_avg_bits: float | None = None, resolution: float = 1e-4
    ) -> None:
        if not math.isfinite(resolution) or resolution <= 0:
            raise InvalidConfigError(
                f"resolution={resolution} must be a positive number of bits per weight"
            )
        self.problem = problem
        self.resolution = resolution
        n_total = problem.total_numel
        self.unit = resolution * n_total  # bits per cost unit
        allowed = problem.allowed  # (L, J)
        base = np.where(allowed, problem.cost_bits, np.inf).min(axis=1)  # (L,)
        self.base_bits = float(base.sum())
        # Whole units above each layer's cheapest option, rounded up (never under-count a cost);
        # an option a layer may not use gets a cost no budget reaches.
        rel = np.where(allowed, problem.cost_bits - base[:, None], 0.0) / self.unit
        self.units = np.where(allowed, np.ceil(rel - 1e-9), _NEVER).astype(np.int64)  # (L, J)
        self.max_units = np.where(allowed, self.units, 0).max(axis=1)  # (L,)
        self.all_grid_bits = float(problem.grid_cost[allowed.any(axis=0)].sum())
        full = int(self.max_units.sum())
        if max_avg_bits is None:
            cap = full
        else:
            self._check_feasible(max_avg_bits)
            cap = max(0, min(full, self._units_for(max_avg_bits * n_total)))
        self.capacity = cap
        self._fill()

    def _units_for(self, layer_bits: float) -> int:
        """Discretised budget for `layer_bits` bits of layers (grids already set aside)."""
        return math.floor((layer_bits - self.base_bits) / self.unit + 1e-9)

    def _check_feasible(self, avg_bits: float) -> float:
        if not math.isfinite(avg_bits):
            raise InvalidConfigError(f"avg_bits={avg_bits} must be a finite number")
        budget = avg_bits * self.problem.total_numel
        lo = self.problem.min_avg_bits()
        if budget < lo * self.problem.total_numel * (1 - 1e-12):
            raise InfeasibleTargetError(
                f"avg_bits={avg_bits:g} is below the smallest feasible budget "
                f"{lo:.4f} bits per weight (every layer on its cheapest option)"
            )
        return budget

    def _fill(self) -> None:
        n_layers, n_opts = self.problem.error.shape
        width = self.capacity + 1
        ptr_dtype = np.uint8 if n_opts <= 255 else np.uint16
        self.pointers = np.zeros((n_layers, width), dtype=ptr_dtype)  # (L, B+1)
        prev = np.zeros(width, dtype=np.float64)  # layers before the first: no error at any budget
        cand = np.empty(width, dtype=np.float64)  # (B+1,) scratch
        better = np.empty(width, dtype=bool)  # (B+1,) scratch
        reach = 0  # S_l: units needed to put layers 0..l all on their costliest option
        for layer in range(n_layers):
            units = self.units[layer]
            err = self.problem.error[layer]
            reach += int(self.max_units[layer])
            # Beyond S_l every assignment fits, so dp and the pointer are constant from S_l on
            # (b - c_j >= S_l - max c = S_(l-1) for every j): compute up to S_l, then copy.
            w = min(width, reach + 1)
            cur = np.full(width, np.inf, dtype=np.float64)  # (B+1,) dp[layer]
            ptr = self.pointers[layer]  # (B+1,) view, filled in place
            # Running minimum over options with a strict '<': ties keep the lowest option index.
            # (Contiguous 1-D passes: much faster than an argmin across a (J, B) stack.)
            for j in range(n_opts):
                c = int(units[j])
                if c >= w:
                    continue
                m = w - c
                np.add(prev[:m], err[j], out=cand[:m])
                np.less(cand[:m], cur[c:w], out=better[:m])
                np.minimum(cur[c:w], cand[:m], out=cur[c:w])
                np.copyto(ptr[c:w], j, where=better[:m], casting="unsafe")
            if w < width:
                cur[w:] = cur[w - 1]
                ptr[w:] = ptr[w - 1]
            prev = cur
        self.best_error = prev  # (B+1,) non-increasing in the budget

    def _backtrack_many(self, budgets: np.ndarray) -> np.ndarray:
        """Option index per layer for each budget in units: (K,) -> (K, L)."""
        b = np.asarray(budgets, dtype=np.int64).copy()  # (K,)
        n_layers = len(self.problem.names)
        choice = np.zeros((b.size, n_layers), dtype=np.int64)  # (K, L)
        for layer in range(n_layers - 1, -1, -1):
            j = self.pointers[layer, b].astype(np.int64)
            choice[:, layer] = j
            b -= self.units[layer, j]
        if np.any(b < 0):  # cannot happen: every pointer was chosen among options that fit
            raise RuntimeError("DP backtrack ran below zero budget")
        return choice

    def _backtrack(self, b: int) -> Allocation:
        return _allocation(self.problem, self._backtrack_many(np.array([b]))[0].tolist())

    def allocate_units(self, b: int) -> Allocation:
        """The DP's allocation for a discretised budget of b units (0 <= b <= capacity)."""
        if not 0 <= b <= self.capacity:
            raise InvalidConfigError(f"budget of {b} units is outside 0..{self.capacity}")
        return self._backtrack(b)

    def allocate(self, avg_bits: float) -> Allocation:
        """Least predicted error with average bits (over the allocated layers, grids included)
        at most `avg_bits`.

        Grids are stored once per artifact, so their cost depends on the whole assignment. Every
        budget b <= b_lo (all grids' storage set aside) fits for sure; budgets in (b_lo, b_hi]
        (no storage set aside) are checked exactly, from the top. The answer is the largest b
        that fits; the DP error is non-increasing in b, so more bits never predict worse.
        """
        budget = self._check_feasible(avg_bits)
        b_lo = min(self._units_for(budget - self.all_grid_bits), self.capacity)
        b_hi = min(self._units_for(budget), self.capacity)
        top = b_hi
        while top > max(b_lo, -1):
            bs = np.arange(top, max(b_lo, -1, top - 4096), -1)  # (K,) candidates, largest first
            choice = self._backtrack_many(bs)  # (K, L)
            fits = self._real_bits(choice) <= budget * (1 + 1e-12)
            if fits.any():
                return self._backtrack(int(bs[int(np.argmax(fits))]))
            top = int(bs[-1]) - 1
        if b_lo < 0:
            raise InfeasibleTargetError(
                f"avg_bits={avg_bits:g} leaves no room for the grids of the cheapest allocation "
                f"({self.problem.min_avg_bits():.4f} bits per weight)"
            )
        return self._backtrack(b_lo)

    def _real_bits(self, choice: np.ndarray) -> np.ndarray:
        """Exact total bits of each row of assignments (K, L) -> (K,): layers + grids used."""
        rows = np.arange(choice.shape[1])[None, :]
        used = np.zeros((choice.shape[0], len(self.problem.options)), dtype=bool)  # (K, J)
        np.put_along_axis(used, choice, True, axis=1)
        bits: np.ndarray = (
            self.problem.cost_bits[rows, choice].sum(axis=1) + used @ self.problem.grid_cost
        )
        return bits

    def smallest_within(self, max_predicted: float) -> Allocation:
        """The smallest allocation whose predicted metric increase is at most `max_predicted`."""
        if not math.isfinite(max_predicted) or max_predicted < 0:
            raise InvalidConfigError(
                f"max predicted increase {max_predicted} must be a finite number >= 0"
            )
        tol = 1e-12 * max(1.0, abs(max_predicted))
        ok = np.nonzero(self.best_error <= max_predicted + tol)[0]
        if ok.size == 0:
            best = float(self.best_error[-1])
            raise InfeasibleTargetError(
                f"no allocation within {(self.base_bits + self.capacity * self.unit) / self.problem.total_numel:.4f}"
                f" bits per weight has a predicted increase <= {max_predicted:g}; the least reachable is {best:.6g}"
            )
        return self._backtrack(int(ok[0]))

    def pareto(self, step_bits: float | None = None) -> list[ParetoPoint]:
        """Predicted metric versus real average bits, Pareto-optimal points only, cheapest first.

        With `step_bits`, one point per step of budget (plus the ends) instead of every breakpoint.
        """
        err = self.best_error
        # A budget is a breakpoint when it buys a strictly lower error than one unit less.
        brk = np.concatenate(([0], np.nonzero(err[1:] < err[:-1])[0] + 1))
        if step_bits is not None:
            if step_bits <= 0:
                raise InvalidConfigError(f"step_bits={step_bits} must be positive")
            stride = max(1, round(step_bits / self.resolution))
            wanted = np.arange(0, self.capacity + 1, stride)
            wanted = np.unique(np.concatenate((wanted, [self.capacity])))
            # the breakpoint reached by each wanted budget (its allocation is the same)
            brk = np.unique(brk[np.searchsorted(brk, wanted, side="right") - 1])
        choice = self._backtrack_many(brk)  # (K, L)
        rows = np.arange(choice.shape[1])[None, :]
        bits = self._real_bits(choice) / self.problem.total_numel  # (K,)
        pred = self.problem.error[rows, choice].sum(axis=1)  # (K,)
        points: list[ParetoPoint] = []
        for k in np.lexsort((pred, bits)).tolist():  # by real bits, then predicted
            # Rounding and grid storage can make a larger budget no better in real bits: keep
            # only the frontier (each point strictly better than every cheaper one).
            if points and pred[k] >= points[-1].predicted:
                continue
            points.append(ParetoPoint(float(bits[k]), float(pred[k])))
        return points


def solve(problem: Problem, max_avg_bits: float | None = None, resolution: float = 1e-4) -> DPTable:
    """Fill the DP table up to `max_avg_bits` (None: up to every layer in its costliest option)."""
    return DPTable(problem, max_avg_bits, resolution)


def allocate(problem: Problem, avg_bits: float, resolution: float = 1e-4) -> Allocation:
    """Best allocation with average bits at most `avg_bits` (table filled only that far)."""
    return DPTable(problem, avg_bits, resolution).allocate(avg_bits)


def brute_force(
    problem: Problem, budget_units: int, units: np.ndarray
) -> tuple[float, tuple[int, ...]] | None:
    """Reference twin: enumerate every assignment (tiny instances only).

    Returns the least error among assignments whose discretised cost fits `budget_units`, and
    the first such assignment in lexicographic order of option indices from the last layer
    back, or None when nothing fits.
    """
    n_layers, n_opts = problem.error.shape
    best: tuple[float, tuple[int, ...]] | None = None
    for choice in itertools.product(range(n_opts), repeat=n_layers):
        if sum(int(units[i, j]) for i, j in enumerate(choice)) > budget_units:
            continue
        e = math.fsum(float(problem.error[i, j]) for i, j in enumerate(choice))
        if best is None or e < best[0]:
            best = (e, choice)
    return best
