"""Speed benchmark: whole-model quantization wall time on SmolLM2-135M's linear weights.

Every method quantizes the same ~106M weights (every nn.Linear except lm_head), in one run on
one machine. HIGGS is timed on `quantize_matrix` (rotation, scales, nearest grid point, bit
packing: everything the native artifact needs); the baselines on their function, which returns
W_hat. The key methods are repeated and interleaved: RTN-4, today's default HIGGS
(`HiggsConfig()`: p=2 n=256, random signs, MSE-searched unbiased scale, the multipliers scored
from a table) and HIGGS p=2 n=256 with the plain RMS scale; the minimum and the median are
reported, and each one's ratio to RTN-4. The default with the exact multiplier search (one
coding pass per multiplier: the search before the table) is timed once, after them, with its
ratio to the same RTN-4 runs. Torch threads: torch's default (recorded) and 1 thread, because on a
shared machine contended threads can be much slower than one.

The end-to-end pipeline (`quantize_checkpoint`, both formats, reading and writing included)
is timed once as well.

Writes benchmarks/results/speed.json and speed.md (`--name` for another stem).

Usage: python -m benchmarks.speed [--repeats 3] [--threads 0 1] [--skip-hqq] [--name speed]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, environment, markdown_table, write_results
from devtools.quality import (
    SMOLLM_DIR,
    Method,
    data_ready,
    higgs_default_fn,
    select_methods,
)

KEY_HIGGS = "HIGGS p=2 n=256"
KEY_RTN = "RTN-4 g128"
KEY_DEFAULT = "HIGGS default --bits 4"
KEY_EXACT = "HIGGS default --bits 4, exact scale search"
# Interleaved in every repeat, in this order; each one's ratio to RTN-4 is reported (the
# exact search too, timed once: it is ~17 coding passes, minutes on a loaded machine).
KEYS = (KEY_RTN, KEY_DEFAULT, KEY_HIGGS)
RATIO_KEYS = (KEY_DEFAULT, KEY_HIGGS, KEY_EXACT)


def exact_default() -> Method:
    """The default config with the exact multiplier search (the search before the table)."""
    return Method(KEY_EXACT, "higgs", *higgs_default_fn(4.0, scale_search="exact"))


def load_linear_weights(model_dir: Path) -> list[torch.Tensor]:
    """The float32 (out, in) weights of every layer the pipeline quantizes, read tensor by tensor."""
    from higgs_engine.model_structure import layer_specs, load_config
    from higgs_engine.safetensors_stream import CheckpointReader

    reader = CheckpointReader(model_dir)
    specs = layer_specs(load_config(model_dir), list(reader.keys()))
    return [s.weight(reader) for s in specs]


def timing_fn(m: Method) -> Any:
    """What is timed for a method: HIGGS's quantize_matrix, or the baseline's function."""
    if m.family == "higgs":
        from higgs_engine.quantize import MatrixSpec, quantize_matrix

        spec = MatrixSpec(
            m.params["p"],
            m.params["n"],
            m.params.get("group_size", 256),
            m.params.get("rotation_block", 1024),
            m.params.get("sign_seed"),
            m.params.get("scale_rule", "rms"),
        )
        scale_search = m.params.get("scale_search", "table")
        return lambda w: quantize_matrix(w, spec, scale_search=scale_search)
    return m.fn


def device_variants() -> dict[str, Any]:
    """HIGGS p=2 n=256 through the accelerator path: the matmul search with its float64
    re-check, on the CPU (what the lookup tables save) and on CUDA when there is one."""
    from higgs_engine.quantize import MatrixSpec, quantize_matrix

    spec = MatrixSpec(2, 256, sign_seed=None, scale_rule="rms")
    out: dict[str, Any] = {
        f"{KEY_HIGGS} matmul search (GPU path) on cpu": lambda w: quantize_matrix(
            w, spec, search="matmul"
        )
    }
    if torch.cuda.is_available():

        def on_cuda(w: torch.Tensor) -> Any:
            q = quantize_matrix(w, spec, device="cuda")
            torch.cuda.synchronize()
            return q

        out[f"{KEY_HIGGS} on cuda"] = on_cuda
    return out


def time_once(fn: Any, weights: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        for w in weights:
            fn(w)
    return time.perf_counter() - t0


def bench_threads(
    threads: int,
    methods: list[Method],
    weights: list[torch.Tensor],
    repeats: int,
    skip_hqq: bool,
    gpu_path: bool = True,
) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    numel = sum(w.numel() for w in weights)
    fns = {m.name: timing_fn(m) for m in methods if m.fn is not None}
    if skip_hqq:
        fns = {k: v for k, v in fns.items() if not k.startswith("HQQ")}
    if gpu_path:
        fns.update(device_variants())
    # warm-up on one matrix (grid loading, HIGGS's nearest-point lookup table build, first-call
    # allocations); timed and reported apart, since a long-lived worker pays it once per grid
    setup: dict[str, float] = {}
    for k, fn in fns.items():
        t0 = time.perf_counter()
        fn(weights[0])
        setup[k] = time.perf_counter() - t0
    times: dict[str, list[float]] = {k: [] for k in fns}
    # the key methods interleaved, so load changes hit them alike
    for _ in range(repeats):
        for k in KEYS:
            if k in fns:
                times[k].append(time_once(fns[k], weights))
                print(f"[speed] threads={threads} {k}: {times[k][-1]:.2f}s", flush=True)
    for k, fn in fns.items():
        if k in KEYS:
            continue
        times[k].append(time_once(fn, weights))
        print(f"[speed] threads={threads} {k}: {times[k][-1]:.2f}s", flush=True)
    rows = []
    for k, ts in times.items():
        best = min(ts)
        rows.append(
            {
                "method": k,
                "threads": threads,
                "seconds_min": best,
                "seconds_median": statistics.median(ts),
                "runs": len(ts),
                "weights": numel,
                "weights_per_s": numel / best,
                "first_call_seconds": setup[k],
            }
        )
    return rows


def pipeline_time(model_dir: Path) -> dict[str, Any]:
    from higgs_engine.pipeline import quantize_checkpoint
    from higgs_engine.planning.config import HiggsConfig

    with tempfile.TemporaryDirectory(prefix="higgs-speed-") as tmp:
        t0 = time.perf_counter()
        report = quantize_checkpoint(model_dir, Path(tmp) / "out", HiggsConfig())
        wall = time.perf_counter() - t0
    return {
        "config": "HiggsConfig() (p=2 n=256, signs, mse-unbiased), formats native+dequantized",
        "wall_seconds": wall,
        "threads": torch.get_num_threads(),
        "stage_seconds": report.timings,
    }


def to_markdown(p: dict[str, Any]) -> str:
    cols = [
        ("method", "method"),
        ("threads", "threads"),
        ("seconds_min", "seconds (min)"),
        ("seconds_median", "seconds (median)"),
        ("runs", "runs"),
        ("weights_per_s", "weights/s"),
        ("first_call_seconds", "first call on 1 matrix, s (setup)"),
    ]
    lines = [f"### Speed: quantizing SmolLM2-135M's {p['weights'] / 1e6:.1f}M linear weights", ""]
    lines.append(markdown_table(p["rows"], cols))
    lines.append("")
    for r in p["ratios"]:
        target = (
            f" (target <= 5x: {'met' if r['ratio'] <= 5 else 'NOT met'})"
            if r.get("method", KEY_HIGGS) == KEY_DEFAULT
            else ""
        )
        lines.append(
            f"- threads={r['threads']}: {r.get('method', KEY_HIGGS)} / RTN-4 = "
            f"**{r['ratio']:.2f}x** (min), {r['ratio_median']:.2f}x (median){target}"
        )
    if p.get("pipeline"):
        pl = p["pipeline"]
        stages = ", ".join(f"{k} {v:.1f}s" for k, v in pl["stage_seconds"].items())
        lines.append(
            f"- end to end `quantize_checkpoint` ({pl['config']}, threads={pl['threads']}): "
            f"{pl['wall_seconds']:.1f}s ({stages})"
        )
    env = p["environment"]["start"]
    lines += [
        "",
        f"Measured {env['date']}, torch {env['torch']}, default threads "
        f"{p['default_threads']}, {env['cpu_count']} CPUs, load average at start "
        f"{env['load_average_1_5_15']}, at end {p['environment']['end']['load_average_1_5_15']}. "
        "The machine is shared with other jobs, so absolute times are noisy; the ratio comes "
        "from interleaved runs of the same process.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="quantization speed of HIGGS vs the baselines")
    ap.add_argument("--repeats", type=int, default=3, help="runs of the HIGGS-256 / RTN-4 pair")
    ap.add_argument("--threads", type=int, nargs="+", default=[0, 1], help="0 = torch's default")
    ap.add_argument("--skip-hqq", action="store_true", help="HQQ is slow; leave it out")
    ap.add_argument(
        "--hqq-threads",
        type=int,
        nargs="*",
        default=[1],
        help="thread settings at which HQQ is timed (default: 1 only)",
    )
    ap.add_argument("--no-pipeline", action="store_true")
    ap.add_argument(
        "--no-gpu-path", action="store_true", help="leave out the matmul-search (GPU path) rows"
    )
    ap.add_argument("--methods", nargs="*", help="subset of method names (default: all)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--name", default="speed", help="results file stem")
    args = ap.parse_args(argv)
    ok, why = data_ready()
    if not ok:
        print(why, file=sys.stderr)
        return 2
    default_threads = torch.get_num_threads()
    env0 = environment()
    weights = load_linear_weights(SMOLLM_DIR)
    numel = sum(w.numel() for w in weights)
    print(
        f"[speed] {len(weights)} matrices, {numel / 1e6:.1f}M weights, default threads {default_threads}"
    )
    methods = select_methods(args.methods, [exact_default()])
    rows: list[dict[str, Any]] = []
    ratios = []
    for th in args.threads:
        threads = th or default_threads
        skip = args.skip_hqq or threads not in [t or default_threads for t in args.hqq_threads]
        part = bench_threads(threads, methods, weights, args.repeats, skip, not args.no_gpu_path)
        by = {r["method"]: r for r in part}
        for key in RATIO_KEYS:
            if key in by and KEY_RTN in by:
                ratios.append(
                    {
                        "threads": threads,
                        "method": key,
                        "ratio": by[key]["seconds_min"] / by[KEY_RTN]["seconds_min"],
                        "ratio_median": by[key]["seconds_median"] / by[KEY_RTN]["seconds_median"],
                    }
                )
        rows += part
    torch.set_num_threads(default_threads)
    pipeline = None if args.no_pipeline else pipeline_time(SMOLLM_DIR)
    payload = {
        "benchmark": "speed",
        "model": "smollm2-135m",
        "matrices": len(weights),
        "weights": numel,
        "default_threads": default_threads,
        "rows": rows,
        "ratios": ratios,
        "pipeline": pipeline,
        "environment": {"start": env0, "end": environment()},
        "timed": "HIGGS: quantize_matrix (codes + scales, packed); baselines: their W -> W_hat function",
    }
    md = to_markdown(payload)
    j, m = write_results(args.name, payload, md, args.out_dir)
    print(md)
    print(f"wrote {j}, {m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
