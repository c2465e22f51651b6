"""Allocator speed on a 7B-scale instance: 224 layers (32 blocks of a Llama-2-7B: q, k, v, o
4096x4096; gate, up 11008x4096; down 4096x11008), 12 options (p=2 grids n=4..4096 + keep
16-bit), budget resolution 1e-4 bits per weight. Alphas are random (log-normal, seeded): the
DP's work does not depend on them.

Measures: the table for one target (filled up to 4.25 bits) and the full table (every budget
up to all-16-bit, what the Pareto curve and the dual need), plus the Pareto extraction.
Writes benchmarks/results/allocator_speed.json and .md.

    python -m benchmarks.allocator_speed [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

from higgs_engine.planning.allocator import AllocLayer, Option, build_problem, solve

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    "q_proj": (4096, 4096),
    "k_proj": (4096, 4096),
    "v_proj": (4096, 4096),
    "o_proj": (4096, 4096),
    "gate_proj": (11008, 4096),
    "up_proj": (11008, 4096),
    "down_proj": (4096, 11008),
}


def instance(seed: int = 0) -> tuple[list[AllocLayer], list[Option]]:
    rng = np.random.default_rng(seed)
    layers = [
        AllocLayer(f"model.layers.{b}.{name}", o, i, float(rng.lognormal(0.0, 1.5)))
        for b in range(32)
        for name, (o, i) in SHAPES.items()
    ]
    options = [Option(2, 2**k) for k in range(2, 13)] + [Option(0, 0)]
    return layers, options


T = TypeVar("T")


def timed(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """Best wall time of `repeats` calls, and the last result."""
    best = float("inf")
    out = fn()
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--resolution", type=float, default=1e-4)
    args = ap.parse_args()
    layers, options = instance()
    from higgs_engine.grids import grid_mse

    t0 = time.perf_counter()
    problem = build_problem(layers, options, mse=lambda o: grid_mse(o.p, o.n))
    t_build = time.perf_counter() - t0
    t_target, table = timed(lambda: solve(problem, 4.25, args.resolution), args.repeats)
    alloc = table.allocate(4.0)
    t_full, full = timed(lambda: solve(problem, None, args.resolution), args.repeats)
    t_pareto, pts = timed(lambda: full.pareto(0.01), args.repeats)
    t_dual, dual = timed(lambda: full.smallest_within(alloc.predicted), args.repeats)
    res = {
        "instance": {
            "layers": len(layers),
            "options": len(options),
            "resolution_bits": args.resolution,
            "weights": problem.total_numel,
        },
        "build_problem_s": t_build,
        "solve_to_4.25_bits_s": t_target,
        "units_to_4.25_bits": table.capacity,
        "solve_full_table_s": t_full,
        "units_full": full.capacity,
        "pareto_s": t_pareto,
        "pareto_points": len(pts),
        "dual_s": t_dual,
        "allocation_at_4_bits": {
            "avg_bits": alloc.avg_bits,
            "predicted": alloc.predicted,
            "histogram": alloc.histogram(),
        },
        "dual_avg_bits": dual.avg_bits,
        "target_s": 2.0,
        "meets_target": t_target < 2.0 and t_full < 2.0,
        "repeats": args.repeats,
        "timing": "best of repeats, wall clock, one process; numpy " + np.__version__,
        "machine": platform.platform() + f", {platform.processor() or 'cpu'}",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "allocator_speed.json").write_text(json.dumps(res, indent=2))
    md = [
        "# Allocator speed (7B-scale instance)",
        "",
        f"{len(layers)} layers x {len(options)} options, resolution {args.resolution:g} bits/weight, "
        f"{problem.total_numel / 1e9:.2f} G weights; best of {args.repeats} runs.",
        "",
        "| step | seconds | budget units |",
        "|---|---|---|",
        f"| DP table up to 4.25 bits (one target) | {t_target:.3f} | {table.capacity} |",
        f"| DP table for every budget (Pareto / dual) | {t_full:.3f} | {full.capacity} |",
        f"| Pareto curve, 0.01-bit steps ({len(pts)} points) | {t_pareto:.3f} | |",
        f"| dual (smallest within a bound) | {t_dual:.4f} | |",
        "",
        f"Target: under 2 s -> {'met' if res['meets_target'] else 'NOT met'}.",
    ]
    (RESULTS / "allocator_speed.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
