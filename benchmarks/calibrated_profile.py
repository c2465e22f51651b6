"""Where calibrated HIGGS spends its time: one `quantize_checkpoint` with a calibration on
SmolLM2 (p=2 n=256, the quality benchmark's 8192 news calibration tokens, 1 torch thread), with
timing wrappers around the engine's stages. Wall and CPU seconds per part:

- forward passes: the calibration pass minus what is listed under it (block forwards with
  float weights for the Hessians and with quantized weights for the next block's inputs);
- Hessian accumulation (HessianAccumulator.add);
- GPTQ per group of layers sharing an input: the sweep (of which the nearest-grid search),
  the Cholesky / inverse factor, the Hessian rotation, the set-up (rotation of W, scales), the
  finish (unrotation, bit packing);
- writing the artifacts (the pipeline's tensor streaming).

Writes benchmarks/results/calibrated_profile.json and .md.
Usage: python -m benchmarks.calibrated_profile [--tokens N]
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, environment, write_results

WALL: dict[str, float] = collections.defaultdict(float)
CPU: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def _wrap(owner: Any, name: str, key: str) -> None:
    fn: Callable[..., Any] = getattr(owner, name)

    def timed(*a: Any, **k: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*a, **k)
        finally:
            WALL[key] += time.perf_counter() - t0
            CPU[key] += time.process_time() - c0
            CALLS[key] += 1

    setattr(owner, name, timed)


def main() -> None:
    from devtools.calibrated import calibration_split
    from devtools.quality import NEWS_FILE, SMOLLM_DIR
    from higgs_engine import calibration as cal_mod
    from higgs_engine import gptq, nearest, pipeline
    from higgs_engine.calibration import DEFAULT_CALIBRATION_TOKENS, load_tokenizer
    from higgs_engine.planning.config import HiggsConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    torch.set_num_threads(1)
    parts = [
        (cal_mod, "run_calibrated", "calibration pass"),
        (gptq.HessianAccumulator, "add", "Hessian accumulation"),
        (gptq, "gptq_higgs_many", "GPTQ (all groups)"),
        (gptq, "_sweep_grid", "sweep"),
        (nearest.PairSearch, "__call__", "nearest-grid search"),
        (gptq, "inverse_cholesky_upper", "Cholesky / inverse factor"),
        (gptq, "rotate_hessian", "Hessian rotation"),
        (gptq, "_higgs_setup", "set-up (rotate W, scales)"),
        (gptq, "_finish", "finish (unrotate, pack)"),
        (gptq, "nearest_searcher", "search tables"),
        (cal_mod, "_capture", "block inputs capture"),
        (pipeline, "stream_tensors", "writing artifacts"),
    ]
    for owner, name, key in parts:
        _wrap(owner, name, key)
    tok = load_tokenizer(SMOLLM_DIR)
    data = calibration_split(tok, NEWS_FILE.read_text(), 40 * 512, args.tokens, 512)
    env = environment()
    with tempfile.TemporaryDirectory(prefix="higgs-prof-") as tmp:
        t0, c0 = time.perf_counter(), time.process_time()
        pipeline.quantize_checkpoint(
            SMOLLM_DIR, Path(tmp) / "out", HiggsConfig(p=2, n=256), calibration=data.calibration
        )
        total_wall, total_cpu = time.perf_counter() - t0, time.process_time() - c0
    inner = ["Hessian accumulation", "GPTQ (all groups)", "block inputs capture"]
    fwd_wall = WALL["calibration pass"] - sum(WALL[k] for k in inner)
    fwd_cpu = CPU["calibration pass"] - sum(CPU[k] for k in inner)
    rows: list[dict[str, Any]] = [
        {"part": "total", "wall_s": total_wall, "cpu_s": total_cpu, "calls": 1}
    ]
    rows.append({"part": "forward passes", "wall_s": fwd_wall, "cpu_s": fwd_cpu, "calls": None})
    for _, _, key in parts:
        rows.append({"part": key, "wall_s": WALL[key], "cpu_s": CPU[key], "calls": CALLS[key]})
    payload = {
        "benchmark": "calibrated_profile",
        "model": "smollm2",
        "calibration": data.description,
        "rows": rows,
        "environment": {"start": env, "end": environment()},
    }
    lines = [
        "### Calibrated HIGGS p=2 n=256 on SmolLM2: where the time goes",
        "",
        "| part | wall s | CPU s | share of CPU | calls |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        share = 100 * r["cpu_s"] / total_cpu if total_cpu else 0.0
        calls = "" if r["calls"] is None else r["calls"]
        lines.append(
            f"| {r['part']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {share:.0f}% | {calls} |"
        )
    lines += [
        "",
        "Nested: the calibration pass holds the forward passes, the Hessian accumulation and "
        "GPTQ; GPTQ holds the sweep (which holds the nearest-grid search), the factor, the "
        "rotation, set-up and finish. Timing wrappers add about a microsecond per call.",
        f"Calibration: {data.description}.",
        f"Measured {env['date']}, torch {env['torch']}, 1 torch thread, load average at start "
        f"{env['load_average_1_5_15']} on {env['cpu_count']} cores (shared machine).",
    ]
    md = "\n".join(lines)
    write_results("calibrated_profile", payload, md, args.out_dir)
    print(md)


if __name__ == "__main__":
    main()
