"""OpenMP's wait policy on a CPU: `higgs quantize` with spinning (ACTIVE) against sleeping
(PASSIVE) idle threads, alone and beside other work, in one run on one machine.

Each run is the CLI in a fresh process (2 OpenMP threads; the policy is read when torch loads
its OpenMP runtime): the uniform `--bits 4` run and the dynamic `--avg-bits 4.13` run with the
model's data-free profile given as a file (`--profile`, so the profile's own cost is left out;
it is measured once before the timed runs, or read from the engine's cache). "Beside other
work" is one extra process keeping one core busy with float32 matrix products, started before
the run and stopped after it. Policies alternate within each repeat. Times are the engine's
own stage times from report.json (quantizing) and the process's wall time.

    python -m benchmarks.omp_wait [--repeats 2] [--avg-bits 4.13]

Writes benchmarks/results/omp_wait.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import cli_quantize, environment, markdown_table, write_results
from devtools.quality import SMOLLM_DIR

BUSY = (
    "import torch\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(384, 384)\n"
    "while True:\n"
    "    a = (a @ a).clamp_(-1, 1)\n"
)
POLICIES = ("ACTIVE", "PASSIVE")


def profile_file(dest: Path) -> Path:
    """SmolLM2's default data-free profile, as a file (from the engine's cache when there)."""
    from devtools.profiles import get_profile
    from higgs_engine.planning.profile import DEFAULT_PROFILE

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "higgs"
    prof = get_profile(SMOLLM_DIR, DEFAULT_PROFILE, cache_dir=cache / "profiles")
    prof.save(dest)
    return dest


def one_run(args: list[str], policy: str, busy: bool, tmp: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": policy}
    load = None
    if busy:
        load = subprocess.Popen([sys.executable, "-c", BUSY], env={**os.environ})
        time.sleep(1.0)  # torch loaded, the core busy
    try:
        wall, rep = cli_quantize(SMOLLM_DIR, args, env, tmp)
    finally:
        if load is not None:
            load.kill()
            load.wait()
    return {"wall_s": wall, "quantizing_s": rep["timings"].get("quantizing")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--avg-bits", type=float, default=4.13)
    args = ap.parse_args()
    env0 = environment()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="higgs-omp-") as d:
        tmp = Path(d)
        prof = profile_file(tmp / "profile.json")
        kinds = {
            "uniform --bits 4": ["--bits", "4"],
            f"dynamic --avg-bits {args.avg_bits} (profile given)": [
                "--avg-bits",
                str(args.avg_bits),
                "--profile",
                str(prof),
            ],
        }
        for rep in range(args.repeats):
            for busy in (False, True):
                for kind, cli in kinds.items():
                    for policy in POLICIES if rep % 2 == 0 else POLICIES[::-1]:
                        r = one_run(cli, policy, busy, tmp)
                        r.update(run=kind, policy=policy, busy=busy, repeat=rep)
                        runs.append(r)
                        print(
                            f"[omp_wait] {kind} {policy} busy={busy}: "
                            f"{r['quantizing_s']:.1f} s quantizing, {r['wall_s']:.1f} s wall",
                            flush=True,
                        )
    rows = []
    for kind in dict.fromkeys(r["run"] for r in runs):
        for busy in (False, True):
            row: dict[str, Any] = {"run": kind, "machine": "1 core busy" if busy else "quiet"}
            for policy in POLICIES:
                sel = [r for r in runs if r["run"] == kind and r["busy"] == busy]
                sel = [r for r in sel if r["policy"] == policy]
                row[policy] = statistics.median(r["quantizing_s"] for r in sel)
                row[f"{policy}_wall"] = statistics.median(r["wall_s"] for r in sel)
            row["ratio"] = row["ACTIVE"] / row["PASSIVE"]
            rows.append(row)
    env1 = environment()
    md = [
        "### OpenMP wait policy: `higgs quantize` on SmolLM2-135M, 2 threads",
        "",
        markdown_table(
            rows,
            [
                ("run", "run"),
                ("machine", "machine"),
                ("ACTIVE", "quantizing s, ACTIVE (spin)"),
                ("PASSIVE", "quantizing s, PASSIVE (sleep)"),
                ("ACTIVE_wall", "wall s, ACTIVE"),
                ("PASSIVE_wall", "wall s, PASSIVE"),
                ("ratio", "ACTIVE / PASSIVE"),
            ],
        ),
        "",
        f"Medians of {args.repeats} runs each (policies alternated); every run:",
        "`"
        + json.dumps(
            [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()} for r in runs]
        )
        + "`",
        "",
        f"Measured {env0['date']} .. {env1['date']}, torch {env0['torch']}, "
        f"{env0['cpu_count']} CPUs, load average at start {env0['load_average_1_5_15']}, "
        f"at end {env1['load_average_1_5_15']} ('1 core busy': one extra process of float32 "
        "matrix products for the length of the run).",
    ]
    write_results(
        "omp_wait",
        {"environment": env0, "environment_end": env1, "rows": rows, "runs": runs},
        "\n".join(md),
    )
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
