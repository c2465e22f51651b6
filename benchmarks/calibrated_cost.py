"""Cost of calibration: data-free vs calibrated quantization, wall time and peak memory.

Per model (SmolLM2-135M, all-MiniLM-L6-v2), in one run, each method in a FRESH Python process
(so each peak is that method's own):

- HIGGS p=2 n=256, data-free: `quantize_checkpoint` (default formats: native + dequantized);
- calibrated HIGGS p=2 n=256: the same call with a calibration (GPTQ with HIGGS grids,
  block-by-block pass);
- RTN-4 g128: round-to-nearest of every quantized layer read from the checkpoint (the data-free
  counterpart of GPTQ int4);
- GPTQ int4 g128: the engine's block-by-block pass with `gptq_rtn` (the data-aware baseline,
  as the quality benchmark runs it).

Calibration text: the news tokens after the quality benchmark's evaluation data (SmolLM2: after
40 windows of 512 tokens, windows of 512; MiniLM: after the 2000 evaluation sentences, windows
of 128), `--tokens` tokens (default: the engine's default). Tokenizing it is timed apart
(`prep_seconds`); `seconds` is the quantization call alone.

Recorded per method: wall seconds, CPU seconds of the process (less sensitive to other load on
a shared machine), peak RSS (VmHWM of the child) and the RSS before the call (imports, data),
the pipeline's stage timings where it has them, the load average before and after. Ratios:
calibrated / data-free for HIGGS (the target: <= 10x) and GPTQ / RTN, in wall and CPU time.

Torch threads: 1 (the benchmark setting) unless --threads.

Writes benchmarks/results/calibrated_cost.json and .md.

Usage: python -m benchmarks.calibrated_cost [--model smollm2|minilm|all] [--tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, environment, fmt, write_results

METHODS = [
    "HIGGS p=2 n=256",
    "calibrated HIGGS p=2 n=256",
    "RTN-4 g128",
    "GPTQ int4 g128",
]
# (calibrated, data-free) pairs whose cost ratio is reported.
PAIRS = [("calibrated HIGGS p=2 n=256", "HIGGS p=2 n=256"), ("GPTQ int4 g128", "RTN-4 g128")]
TARGET_RATIO = 10.0


def _vm(field: str) -> float:
    """A /proc/self/status memory field in MiB (VmHWM: peak RSS, VmRSS: current)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _calibration(model: str, tokens: int) -> Any:
    """The calibration windows the quality benchmark uses for `model`."""
    from devtools.calibrated import calibration_split
    from devtools.quality import MINILM_DIR, NEWS_FILE, SMOLLM_DIR, news_sentences
    from higgs_engine.calibration import load_tokenizer

    text = NEWS_FILE.read_text()
    if model == "smollm2":
        tok = load_tokenizer(SMOLLM_DIR)
        return calibration_split(tok, text, 40 * 512, tokens, 512).calibration
    tok = load_tokenizer(MINILM_DIR)
    sents = news_sentences(text, 2000)
    offset = text.find(sents[-1]) + len(sents[-1])
    return calibration_split(tok, text[offset:], 0, tokens, 128).calibration


def _gptq_int4(model_dir: Path, calibration: Any) -> dict[str, Any]:
    import torch

    from higgs_engine.calibration import run_calibrated
    from higgs_engine.methods import METHODS, Precision
    from higgs_engine.model_structure import layer_specs, load_config
    from higgs_engine.safetensors_stream import CheckpointReader
    from higgs_engine.sources import resolve_model

    count = 0
    int4 = Precision(bits=4, group_size=128)

    def quantize(group: list[Any], ws: list[torch.Tensor], h: torch.Tensor) -> list[torch.Tensor]:
        nonlocal count
        res = METHODS["gptq-int4"].quantize_many(ws, int4, hessian=h)
        count += len(ws)
        return [r.w_hat for r in res]

    cfg = load_config(model_dir)
    with CheckpointReader(model_dir) as reader:
        specs = layer_specs(cfg, reader.keys())
        outside = run_calibrated(resolve_model(model_dir), reader, specs, calibration, quantize)
        for name in outside:  # outside the blocks (a pooler): plain RTN, as the quality bench
            spec = next(s for s in specs if s.name == name)
            METHODS["rtn"].quantize(spec.weight(reader), int4)
    return {"layers": count + len(outside), "layers_without_data": outside}


def _rtn4(model_dir: Path) -> dict[str, Any]:
    from higgs_engine.methods import METHODS, Precision
    from higgs_engine.model_structure import layer_specs, load_config
    from higgs_engine.safetensors_stream import CheckpointReader

    cfg = load_config(model_dir)
    with CheckpointReader(model_dir) as reader:
        specs = layer_specs(cfg, reader.keys())
        for spec in specs:
            METHODS["rtn"].quantize(spec.weight(reader), Precision(bits=4, group_size=128))
    return {"layers": len(specs)}


def child(model: str, method: str, tokens: int, threads: int) -> dict[str, Any]:
    """One method on one model, in this (fresh) process."""
    import torch

    from devtools.quality import MINILM_DIR, SMOLLM_DIR
    from higgs_engine.pipeline import quantize_checkpoint
    from higgs_engine.planning.config import HiggsConfig

    torch.set_num_threads(threads)
    model_dir = SMOLLM_DIR if model == "smollm2" else MINILM_DIR
    calibrated = method in ("calibrated HIGGS p=2 n=256", "GPTQ int4 g128")
    t0 = time.perf_counter()
    calibration = _calibration(model, tokens) if calibrated else None
    prep = time.perf_counter() - t0
    rss_before = _vm("VmRSS")
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="higgs-cost-") as tmp:
        c0, t0 = time.process_time(), time.perf_counter()
        if method.endswith("HIGGS p=2 n=256"):
            rep = quantize_checkpoint(
                model_dir, Path(tmp) / "out", HiggsConfig(p=2, n=256), calibration=calibration
            )
            extra["stages"] = {k: round(v, 2) for k, v in rep.timings.items()}
            extra["bits_per_weight"] = rep.bits_per_weight
        elif method == "GPTQ int4 g128":
            extra.update(_gptq_int4(model_dir, calibration))
        else:
            extra.update(_rtn4(model_dir))
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "model": model,
        "method": method,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "prep_seconds": prep,
        "peak_rss_mib": _vm("VmHWM"),
        "rss_before_mib": rss_before,
        "calibration": None if calibration is None else calibration.describe(),
        "torch_threads": torch.get_num_threads(),
        **extra,
    }


def run_child(model: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.calibrated_cost",
        "--child",
        model,
        method,
        "--tokens",
        str(args.tokens),
        "--threads",
        str(args.threads),
    ]
    load0 = os.getloadavg()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    load1 = os.getloadavg()
    if proc.returncode != 0:
        return {"model": model, "method": method, "error": proc.stderr.strip()[-2000:]}
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    row["load_average_1min_before_after"] = [round(load0[0], 2), round(load1[0], 2)]
    return row


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["method"]: r for r in rows if r["model"] == model and "error" not in r}
        for cal, free in PAIRS:
            if cal not in by or free not in by:
                continue
            wall = by[cal]["seconds"] / by[free]["seconds"]
            cpu = by[cal]["cpu_seconds"] / by[free]["cpu_seconds"]
            out.append(
                {
                    "model": model,
                    "calibrated": cal,
                    "data_free": free,
                    "wall_ratio": wall,
                    "cpu_ratio": cpu,
                    "peak_rss_ratio": by[cal]["peak_rss_mib"] / by[free]["peak_rss_mib"],
                    "target_ratio": TARGET_RATIO if cal.startswith("calibrated HIGGS") else None,
                    "met": (wall <= TARGET_RATIO and cpu <= TARGET_RATIO)
                    if cal.startswith("calibrated HIGGS")
                    else None,
                }
            )
    return out


def to_markdown(p: dict[str, Any]) -> str:
    lines = [
        "### Cost of calibration: data-free vs calibrated (each method in a fresh process)",
        "",
        "| model | method | wall s | CPU s | peak RSS MiB | RSS before MiB | calibration tokens "
        "| load avg before/after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in p["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['method']} | error | | | | | |")
            continue
        cal = r["calibration"]["tokens"] if r.get("calibration") else "-"
        la = r.get("load_average_1min_before_after", ["-", "-"])
        lines.append(
            f"| {r['model']} | {r['method']} | {fmt(r['seconds'])} | {fmt(r['cpu_seconds'])} "
            f"| {r['peak_rss_mib']:.0f} | {r['rss_before_mib']:.0f} | {cal} | {la[0]} / {la[1]} |"
        )
    lines += ["", "Ratios (calibrated / data-free):", ""]
    for q in p["ratios"]:
        verdict = ""
        if q["target_ratio"] is not None:
            verdict = f" (target <= {q['target_ratio']:g}x: **{'met' if q['met'] else 'NOT met'}**)"
        lines.append(
            f"- {q['model']}: {q['calibrated']} / {q['data_free']}: {q['wall_ratio']:.1f}x wall, "
            f"{q['cpu_ratio']:.1f}x CPU, peak RSS {q['peak_rss_ratio']:.2f}x{verdict}"
        )
    env = p["environment"]["start"]
    lines += [
        "",
        f"Measured {env['date']}, torch {env['torch']}, {p['threads']} torch thread(s) per "
        f"method, load average at start {env['load_average_1_5_15']} on {env['cpu_count']} "
        "cores (a shared machine: wall seconds are noisy, CPU seconds less so). Seconds are "
        "the quantization call alone; tokenizing the calibration text is `prep_seconds` in "
        "the JSON. HIGGS rows: quantize_checkpoint writing both artifact formats.",
    ]
    for r in p["rows"]:
        if r.get("stages"):
            lines.append(f"- {r['model']} {r['method']} stages (s): {r['stages']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "minilm", "all"], default="all")
    ap.add_argument("--tokens", type=int, default=None, help="calibration tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", nargs="*", default=None, choices=METHODS)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokens is None:
        from higgs_engine.calibration import DEFAULT_CALIBRATION_TOKENS

        args.tokens = DEFAULT_CALIBRATION_TOKENS
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.tokens, args.threads)))
        return
    from devtools.quality import data_ready

    ok, why = data_ready()
    if not ok:
        sys.exit(why)
    models = ["smollm2", "minilm"] if args.model == "all" else [args.model]
    env = environment()
    rows: list[dict[str, Any]] = []
    for model in models:
        for method in args.methods or METHODS:
            row = run_child(model, method, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    payload = {
        "benchmark": "calibrated_cost",
        "threads": args.threads,
        "tokens": args.tokens,
        "rows": rows,
        "ratios": ratios(rows),
        "environment": {"start": env, "end": environment()},
    }
    md = to_markdown(payload)
    write_results("calibrated_cost", payload, md, args.out_dir)
    print(md)


if __name__ == "__main__":
    main()
