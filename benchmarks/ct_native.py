"""compressed-tensors `--bits 4` against native HIGGS `--bits 4`, side by side in one run: wall
time of `higgs quantize` (fresh processes, interleaved, so machine load hits both alike), the
bits per weight each counts, the bytes on disk of each artifact, and the quality of each output
as its users load it (the compressed-tensors directory through transformers, the native one
through the project's loader), on SmolLM2-135M and all-MiniLM-L6-v2.

Quality: SmolLM2, perplexity and KL from the 16-bit model on the first W windows of 512 tokens
of the news text; MiniLM, mean 1 - cos of the mean-pooled sentence embeddings against the
16-bit model's on the first S news sentences.

    python -m benchmarks.ct_native [--repeats R] [--windows W] [--sentences S]

Writes benchmarks/results/ct_native.json and .md. The target: the
compressed-tensors run within 3x the native run's wall time.
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

from benchmarks.common import environment, markdown_table, write_results

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"smollm2": ROOT / "data" / "smollm2-135m", "minilm": ROOT / "data" / "minilm"}
FORMATS = {"native": "native", "compressed-tensors": "compressed-tensors"}
TARGET_RATIO = 3.0


def quantize(src: Path, fmt: str, out: Path) -> tuple[float, dict[str, Any]]:
    """`higgs quantize SRC --format FMT --bits 4` in a fresh process: wall seconds, report."""
    higgs = Path(sys.executable).with_name("higgs")
    cmd = [str(higgs), "quantize", str(src), "--out", str(out), "--format", fmt, "--bits", "4"]
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, "--quiet"], capture_output=True, text=True, env=dict(os.environ))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return wall, json.loads((out / "report.json").read_text())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def weight_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def evaluate(model: str, dirs: dict[str, Path], windows: int, sentences: int) -> dict[str, Any]:
    """Each output's quality as its users load it, on the same windows / sentences."""
    import torch

    from devtools.quality import (
        NEWS_FILE,
        CausalLMEval,
        EmbeddingEval,
        load_causal_lm,
        load_encoder,
        news_sentences,
    )
    from higgs_engine.artifacts import load_model

    src = MODELS[model]
    text = NEWS_FILE.read_text(encoding="utf-8")
    base, tok = load_causal_lm(src) if model == "smollm2" else load_encoder(src)
    ev: CausalLMEval | EmbeddingEval = (
        CausalLMEval(tok, text, 512, windows)
        if model == "smollm2"
        else EmbeddingEval(tok, news_sentences(text, sentences))
    )
    out: dict[str, Any] = {"base": ev.prepare_base(base)}
    del base
    for fmt, d in dirs.items():
        if fmt == "native":
            m, _ = load_model(d / "native", dtype=torch.float32)
        else:
            m, _ = (load_causal_lm if model == "smollm2" else load_encoder)(d / fmt)
        out[fmt] = ev.evaluate(m)
        del m
    return out


def run_model(model: str, repeats: int, windows: int, sentences: int, work: Path) -> dict[str, Any]:
    walls: dict[str, list[float]] = {f: [] for f in FORMATS}
    reports: dict[str, dict[str, Any]] = {}
    last: dict[str, Path] = {}
    for r in range(repeats):
        order = list(FORMATS) if r % 2 == 0 else list(reversed(FORMATS))
        for fmt in order:
            out = work / f"{model}-{fmt}-{r}"
            wall, rep = quantize(MODELS[model], fmt, out)
            walls[fmt].append(wall)
            reports[fmt] = rep
            last[fmt] = out
    quality = evaluate(model, last, windows, sentences)
    rows = []
    for fmt in FORMATS:
        rep, d = reports[fmt], last[fmt] / fmt
        rows.append(
            {
                "model": model,
                "format": fmt,
                "bits_per_weight": rep["bits_per_weight"],
                "weights_bytes": weight_bytes(d),
                "dir_bytes": dir_bytes(d),
                "wall_min_s": min(walls[fmt]),
                "wall_median_s": statistics.median(walls[fmt]),
                "walls_s": walls[fmt],
                "engine_total_s": rep["timings"].get("total"),
                **{k: v for k, v in quality[fmt].items() if k in ("ppl", "kl", "one_minus_cos")},
            }
        )
    ratio = rows[1]["wall_median_s"] / rows[0]["wall_median_s"]
    return {
        "model": model,
        "rows": rows,
        "base": quality["base"],
        "ratio_median": ratio,
        "target_met": ratio <= TARGET_RATIO,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--sentences", type=int, default=500)
    ap.add_argument("--models", default="smollm2,minilm")
    args = ap.parse_args(argv)
    env_before = environment()
    results = []
    with tempfile.TemporaryDirectory(prefix="ct-bench-") as tmp:
        for model in args.models.split(","):
            results.append(run_model(model, args.repeats, args.windows, args.sentences, Path(tmp)))
    env_after = environment()
    payload = {
        "environment": env_before,
        "load_average_after": env_after["load_average_1_5_15"],
        "repeats": args.repeats,
        "windows": args.windows,
        "sentences": args.sentences,
        "target_ratio": TARGET_RATIO,
        "results": results,
    }
    cols = [
        ("model", "model"),
        ("format", "format"),
        ("bits_per_weight", "bits/weight"),
        ("weights_bytes", "weight bytes"),
        ("wall_median_s", "quantize s (median)"),
        ("wall_min_s", "quantize s (min)"),
        ("ppl", "perplexity"),
        ("kl", "KL from base"),
        ("one_minus_cos", "1 - cos"),
    ]
    lines = [
        "## compressed-tensors against native HIGGS, `--bits 4`",
        "",
        markdown_table([row for r in results for row in r["rows"]], cols),
        "",
    ]
    for r in results:
        base = r["base"]
        base_txt = (
            f"base perplexity {base['ppl']:.3f}"
            if "ppl" in base
            else f"{base['sentences']} sentences"
        )
        lines.append(
            f"- {r['model']}: compressed-tensors / native wall time (medians of {args.repeats} "
            f"interleaved runs) = {r['ratio_median']:.2f}x, target <= {TARGET_RATIO:g}x: "
            f"{'met' if r['target_met'] else 'missed'}; {base_txt}."
        )
    lines += [
        "",
        f"SmolLM2: {args.windows} windows x 512 tokens of news text; MiniLM: the first "
        f"{args.sentences} news sentences. compressed-tensors loaded by transformers through "
        "compressed-tensors, native by the project's loader, both in float32. Load average "
        f"{env_before['load_average_1_5_15']} before, {env_after['load_average_1_5_15']} after; "
        f"{env_before['date']}.",
    ]
    write_results("ct_native", payload, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
