"""A whole run as a new user makes it: `higgs quantize --bits 4` against `--avg-bits 4.13` with
an empty cache, the CLI in a fresh process each time, on the same machine in one run.

For each model, three runs in this order: uniform (`--bits 4`), dynamic (`--avg-bits 4.13`
with empty profile and self-generated text caches: XDG_CACHE_HOME and --profile-cache point at
new temporary folders, so the data-free profile is measured from nothing), uniform again (the
two uniform runs bracket the dynamic one, so a change of machine load shows). The ratio is the
dynamic run's wall time over the mean of the two uniform runs. Stage times come from each run's
report.json (the engine's own timings); wall time includes starting Python and loading torch.

    python -m benchmarks.full_run [--model smollm2|minilm|all] [--avg-bits 4.13]
        [--threads 2] [--name full_run]

Writes benchmarks/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import cli_quantize, environment, fmt, markdown_table, write_results
from devtools.quality import MINILM_DIR, SMOLLM_DIR

MODELS = {"smollm2": SMOLLM_DIR, "minilm": MINILM_DIR}


def one_run(src: Path, args: list[str], env: dict[str, str], tmp: Path) -> dict[str, Any]:
    wall, rep = cli_quantize(src, args, env, tmp)
    return {
        "args": " ".join(args),
        "wall_s": wall,
        "timings": rep.get("timings", {}),
        "bits_per_weight": rep.get("bits_per_weight"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=[*MODELS, "all"], default="all")
    ap.add_argument("--avg-bits", type=float, default=4.13)
    ap.add_argument("--threads", type=int, default=2, help="OMP/MKL threads of each run")
    ap.add_argument("--name", default="full_run", help="results file stem")
    args = ap.parse_args()
    names = list(MODELS) if args.model == "all" else [args.model]
    env_before = environment()
    rows: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        with tempfile.TemporaryDirectory(prefix="higgs-full-run-") as d:
            tmp = Path(d)
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            env["MKL_NUM_THREADS"] = str(args.threads)
            uniform = ["--bits", "4"]
            cache = tmp / "cache"
            dynamic = ["--avg-bits", str(args.avg_bits), "--profile-cache", str(cache / "p")]
            dyn_env = {**env, "XDG_CACHE_HOME": str(cache)}
            u1 = one_run(MODELS[name], uniform, env, tmp)
            print(f"[full_run] {name} uniform: {u1['wall_s']:.1f} s", flush=True)
            dy = one_run(MODELS[name], dynamic, dyn_env, tmp)
            print(f"[full_run] {name} dynamic: {dy['wall_s']:.1f} s", flush=True)
            u2 = one_run(MODELS[name], uniform, env, tmp)
            print(f"[full_run] {name} uniform again: {u2['wall_s']:.1f} s", flush=True)
        runs[name] = [u1, dy, u2]
        base = (u1["wall_s"] + u2["wall_s"]) / 2
        t = dy["timings"]
        rows.append(
            {
                "model": name,
                "uniform_s": f"{fmt(u1['wall_s'])} / {fmt(u2['wall_s'])}",
                "dynamic_s": dy["wall_s"],
                "generating_s": t.get("generating"),
                "profiling_s": t.get("profiling"),
                "quantizing_s": t.get("quantizing"),
                "ratio": dy["wall_s"] / base,
                "met": dy["wall_s"] / base <= 3.0,
            }
        )
    env_after = environment()
    md = [
        "### A whole run: `--bits 4` vs `--avg-bits "
        f"{args.avg_bits}` with an empty cache (CLI, fresh process each)",
        "",
        markdown_table(
            rows,
            [
                ("model", "model"),
                ("uniform_s", "--bits 4 wall s (before / after)"),
                ("dynamic_s", f"--avg-bits {args.avg_bits} wall s"),
                ("generating_s", "of which generating s"),
                ("profiling_s", "profiling s"),
                ("quantizing_s", "quantizing s"),
                ("ratio", "dynamic / uniform"),
                ("met", "within 3x"),
            ],
        ),
        "",
        f"Stage times of each run (report.json): `{json.dumps({k: [r['timings'] for r in v] for k, v in runs.items()})}`",
        "",
        f"Measured {env_before['date']} .. {env_after['date']}, torch {env_before['torch']}, "
        f"{args.threads} threads per run, {env_before['cpu_count']} CPUs, load average at start "
        f"{env_before['load_average_1_5_15']}, at end {env_after['load_average_1_5_15']} "
        "(a shared machine: the two uniform runs bracket the dynamic one).",
    ]
    payload = {
        "environment": env_before,
        "environment_after": env_after,
        "threads": args.threads,
        "avg_bits": args.avg_bits,
        "rows": rows,
        "runs": runs,
    }
    write_results(args.name, payload, "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
