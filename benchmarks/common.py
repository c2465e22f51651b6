"""Result writing shared by the benchmarks: the environment a run measured in, JSON + markdown
tables (+ PNG plots) into benchmarks/results/. The competitors, simulated quantization and the
quality evaluators live in devtools/quality.py (the CI quality check uses them too)."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def environment() -> dict[str, Any]:
    import transformers

    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "load_average_1_5_15": [round(x, 2) for x in load],
    }


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(key)) for key, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def cli_quantize(
    src: Path, args: Sequence[str], env: dict[str, str], out_root: Path
) -> tuple[float, dict[str, Any]]:
    """`higgs quantize SRC --out <new folder under out_root> --quiet ARGS` in a fresh process
    with `env`: its wall time and its report.json (a failed run stops the benchmark)."""
    out = out_root / f"out-{time.monotonic_ns()}"
    higgs = Path(sys.executable).with_name("higgs")
    cmd = [str(higgs), "quantize", str(src), "--out", str(out), "--quiet", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return wall, json.loads((out / "report.json").read_text())


def write_results(
    name: str, payload: dict[str, Any], markdown: str, out_dir: Path = RESULTS_DIR
) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    md_path = out_dir / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path


_MARKERS = {"rtn": "s", "nf4": "D", "hqq": "^", "higgs": "o", "dynamic": "*"}


def plot_bits_vs_metric(
    rows: Sequence[dict[str, Any]],
    metric: str,
    title: str,
    path: Path,
    base_value: float | None = None,
    log_y: bool = True,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fam, marker in _MARKERS.items():
        pts = [
            r for r in rows if r["family"] == fam and r.get(metric) is not None and r.get("bits")
        ]
        if not pts:
            continue
        pts = sorted(pts, key=lambda r: r["bits"])
        ax.plot(
            [r["bits"] for r in pts],
            [r[metric] for r in pts],
            marker=marker,
            linestyle="-" if fam == "higgs" else "none",
            label=fam.upper(),
        )
        for r in pts:
            ax.annotate(
                r["method"],
                (r["bits"], r[metric]),
                fontsize=7,
                xytext=(4, 3),
                textcoords="offset points",
            )
    if base_value is not None:
        ax.axhline(base_value, color="grey", linestyle=":", label="base")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("total bits per weight (quantized layers, all overheads)")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
