"""Our compressed-tensors checkpoints side by side with llm-compressor's, in one run, on the CPU:
SmolLM2-135M and all-MiniLM-L6-v2.

llm-compressor (from PyPI, in its own virtual environment: 0.14 pins an older transformers; made
here on first use at --venv) runs three recipes through benchmarks/llmcompressor_recipes.py,
int4 symmetric weights in the largest group of 128 / 64 / 32 that divides every linear layer's
input width (SmolLM2: 64, MiniLM: 128):
    lc W4A16         its default observer
    lc W4A16 mse     its MSE observer
    lc GPTQ          GPTQ on --samples windows of 512 tokens (MiniLM: 128) of the second half
                     of the news text (the evaluation reads the first windows)
Ours, by `higgs quantize --format compressed-tensors`:
    ours --bits 4    int4 everywhere, group 128 where the width allows it
    ours @ <anchor>  the allocator (--avg-bits) at each llm-compressor checkpoint's weight-file
                     size: the budget is our --bits 4 run's bits per linear weight plus the
                     anchor's extra bytes over it, spread over the linear weights (the rest of
                     both files, embeddings and norms in float16, is the same)
    ours calibrated @ lc GPTQ
                     the same allocation at the GPTQ anchor's size with --calibration: GPTQ in
                     each layer's scheme (activation order, MSE scales), on the same calibration
                     text and as many tokens as llm-compressor's GPTQ
Every directory is loaded the same way, by transformers through compressed-tensors in float32,
and measured on the same text: SmolLM2, perplexity and KL from the 16-bit model on the first
--windows windows of 512 tokens of the news text; MiniLM, mean 1 - cos of the mean-pooled
sentence embeddings against the 16-bit model's on the first --sentences news sentences (the
profile's metric there is 1 - cos too). Sizes are the bytes of the stored tensors (the
safetensors files less their JSON headers);
times, each quantization's wall time (a fresh process each; llm-compressor's oneshot seconds
beside it).

Targets, each reported met or missed: at equal or smaller size, lower KL (MiniLM: 1 - cos) than
every data-free llm-compressor recipe with a data-free path of ours, and than its GPTQ recipe
with the calibrated one; the allocator's predicted
change within 20% of the measured one; our --bits 4 no slower than llm-compressor's W4A16.

    python -m benchmarks.llmcompressor [--models smollm2,minilm] [--samples N] [--windows W]
        [--sentences S] [--venv DIR]

Writes benchmarks/results/llmcompressor.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import environment, markdown_table, write_results

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"smollm2": ROOT / "data" / "smollm2-135m", "minilm": ROOT / "data" / "minilm"}
LC_VERSION = "0.14.0.1"
RECIPES = {"lc W4A16": "w4a16", "lc W4A16 mse": "w4a16-mse", "lc GPTQ": "gptq"}
CALIBRATED = "ours calibrated @ lc GPTQ"
DATA_FREE = ("lc W4A16", "lc W4A16 mse")
PREDICTION_TOLERANCE = 0.20
SEQ_LEN = {"smollm2": 512, "minilm": 128}


def ensure_venv(venv: Path) -> Path:
    """llm-compressor's own environment (the tested torch first, as scripts/setup does)."""
    import torch

    py = venv / "bin" / "python"
    if py.is_file():
        return py
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    torch_spec = f"torch=={torch.__version__.split('+')[0]}"
    for spec in (torch_spec, f"llmcompressor=={LC_VERSION}"):
        subprocess.run([str(py), "-m", "pip", "install", "-q", spec], check=True)
    return py


def group_for(src: Path) -> int:
    """The largest of 128, 64, 32 that divides every linear layer's input width."""
    from higgs_engine.ct.writer import ct_layers

    widths = {s.in_features for s in ct_layers(src)}
    return next(g for g in (128, 64, 32) if all(w % g == 0 for w in widths))


def weight_bytes(d: Path) -> int:
    """The bytes of the stored tensors (the safetensors files less their JSON headers, whose
    length varies with how the writer orders and names them)."""
    import struct

    total = 0
    for p in d.glob("*.safetensors"):
        with p.open("rb") as f:
            header = struct.unpack("<Q", f.read(8))[0]
        total += p.stat().st_size - 8 - header
    return total


def run_lc(py: Path, src: Path, recipe: str, group: int, out: Path, calib: Path, args: Any,
           seq_len: int) -> dict[str, Any]:  # fmt: skip
    cmd = [str(py), "-P", str(ROOT / "benchmarks" / "llmcompressor_recipes.py"),
           "--model", str(src), "--recipe", recipe, "--group", str(group), "--out", str(out),
           "--calibration", str(calib), "--samples", str(args.samples),
           "--seq-len", str(seq_len)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"llm-compressor {recipe} failed: {proc.stderr[-3000:]}")
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "oneshot_s": line["seconds"], "observer": line["observer"]}


def run_ours(src: Path, extra: list[str], out: Path, cache: Path) -> dict[str, Any]:
    higgs = Path(sys.executable).with_name("higgs")
    cmd = [str(higgs), "quantize", str(src), "--out", str(out), "--format",
           "compressed-tensors", "--quiet", "--profile-cache", str(cache), *extra]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-3000:]}")
    rep = json.loads((out / "report.json").read_text())
    m = rep["metrics"]
    return {
        "wall_s": wall,
        "bits_per_weight": rep["bits_per_weight"],
        "predicted": m.get(f"predicted_{m['profile']['metric']}") if "profile" in m else None,
        "metric": m["profile"]["metric"] if "profile" in m else None,
        "profile_reused": (m.get("allocation") or {}).get("profile_reused"),
        "schemes": m["schemes"],
    }


class Evaluator:
    """The same text for every directory, each loaded by transformers in float32."""

    def __init__(self, model: str, windows: int, sentences: int) -> None:
        from devtools.quality import (
            NEWS_FILE,
            CausalLMEval,
            EmbeddingEval,
            load_causal_lm,
            load_encoder,
            news_sentences,
        )

        self.causal = model == "smollm2"
        self.load = load_causal_lm if self.causal else load_encoder
        text = NEWS_FILE.read_text(encoding="utf-8")
        base, tok = self.load(MODELS[model])
        self.ev: Any = (
            CausalLMEval(tok, text, 512, windows)
            if self.causal
            else EmbeddingEval(tok, news_sentences(text, sentences))
        )
        self.base = self.ev.prepare_base(base)

    def __call__(self, d: Path) -> dict[str, Any]:
        import contextlib
        import io

        with contextlib.redirect_stderr(io.StringIO()):
            m, _ = self.load(d)
        res: dict[str, Any] = self.ev.evaluate(m)
        return res


def run_model(model: str, py: Path, args: Any, work: Path) -> dict[str, Any]:
    from higgs_engine.ct.writer import ct_layers

    src = MODELS[model]
    group = group_for(src)
    numel = sum(s.numel for s in ct_layers(src))
    text = (ROOT / "data" / "news.txt").read_text(encoding="utf-8")
    calib = work / "calibration.txt"
    calib.write_text(text[len(text) // 2 :], encoding="utf-8")
    cache = work / f"profiles-{model}"
    rows: list[dict[str, Any]] = []
    dirs: dict[str, Path] = {}
    for name, recipe in RECIPES.items():
        out = work / f"{model}-{recipe}"
        info = run_lc(py, src, recipe, group, out, calib, args, SEQ_LEN[model])
        rows.append({"method": name, "data_free": name in DATA_FREE, **info})
        dirs[name] = out
    out = work / f"{model}-ours-b4"
    ours4 = run_ours(src, ["--bits", "4"], out, cache)
    dirs["ours --bits 4"] = out / "compressed-tensors"
    rows.append({"method": "ours --bits 4", "data_free": True, **ours4})
    b4_bytes = weight_bytes(dirs["ours --bits 4"])
    for name in RECIPES:
        anchor = weight_bytes(dirs[name])
        # never below --bits 4, the cheapest our menu allows (file headers differ by bytes)
        budget = ours4["bits_per_weight"] + max(0.0, 8.0 * (anchor - b4_bytes) / numel)
        label = f"ours @ {name}"
        out = work / f"{model}-ours-{RECIPES[name]}"
        info = run_ours(src, ["--avg-bits", f"{budget:.6f}"], out, cache)
        dirs[label] = out / "compressed-tensors"
        rows.append({"method": label, "data_free": True, "budget": budget, "anchor": name, **info})
    # calibrated HIGGS for this format: GPTQ in each layer's scheme, at the GPTQ anchor's size,
    # on the same calibration text and token count as llm-compressor's GPTQ
    budget = next(r["budget"] for r in rows if r.get("anchor") == "lc GPTQ")
    out = work / f"{model}-ours-calibrated"
    tokens = args.samples * SEQ_LEN[model]
    calibrated = ["--avg-bits", f"{budget:.6f}", "--calibration", str(calib),
                  "--calibration-tokens", str(tokens)]  # fmt: skip
    info = run_ours(src, calibrated, out, cache)
    dirs[CALIBRATED] = out / "compressed-tensors"
    rows.append({"method": CALIBRATED, "data_free": False, "budget": budget,
                 "anchor": "lc GPTQ", "calibration_tokens": tokens, **info})  # fmt: skip
    ev = Evaluator(model, args.windows, args.sentences)
    for row in rows:
        d = dirs[row["method"]]
        row["weights_bytes"] = weight_bytes(d)
        row.update(ev(d))
    key = "kl" if ev.causal else "one_minus_cos"
    by = {r["method"]: r for r in rows}
    targets = []
    for name in RECIPES:
        theirs, ours = by[name], by[f"ours @ {name}"]
        if name in DATA_FREE:
            smaller = ours["weights_bytes"] <= theirs["weights_bytes"]
            met = smaller and ours[key] < theirs[key]
            targets.append({
                "target": f"data-free ours below {name} at equal or smaller size",
                "met": met,
                "figures": f"{key} {ours[key]:.4g} vs {theirs[key]:.4g}, "
                f"{ours['weights_bytes']} vs {theirs['weights_bytes']} bytes",
            })  # fmt: skip
        else:
            cal = by[CALIBRATED]
            smaller = cal["weights_bytes"] <= theirs["weights_bytes"]
            targets.append({
                "target": f"calibrated ours below {name} at equal or smaller size",
                "met": smaller and cal[key] < theirs[key],
                "figures": f"{key} {cal[key]:.4g} vs {theirs[key]:.4g}, "
                f"{cal['weights_bytes']} vs {theirs['weights_bytes']} bytes, "
                f"{cal['wall_s']:.0f} s vs {theirs['wall_s']:.0f} s",
            })  # fmt: skip
    for r in rows:
        if r.get("predicted") is None or not r["method"].startswith("ours @"):
            continue
        measured = r[key]
        rel = abs(r["predicted"] - measured) / measured if measured else math.inf
        r["prediction_error"] = rel
        targets.append({
            "target": f"{r['method']}: predicted within 20% of measured",
            "met": rel <= PREDICTION_TOLERANCE,
            "figures": f"predicted {r['predicted']:.4g}, measured {measured:.4g} ({rel:.0%})",
        })  # fmt: skip
    lc4 = by["lc W4A16"]
    targets.append({
        "target": "ours --bits 4 no slower than lc W4A16 (wall time, a fresh process each)",
        "met": ours4["wall_s"] <= lc4["wall_s"],
        "figures": f"{ours4['wall_s']:.1f} s vs {lc4['wall_s']:.1f} s",
    })  # fmt: skip
    return {"model": model, "group": group, "base": ev.base, "metric": key, "rows": rows,
            "targets": targets}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,minilm")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--sentences", type=int, default=500)
    ap.add_argument("--venv", type=Path, default=ROOT / ".bench-venvs" / "llmcompressor")
    args = ap.parse_args(argv)
    py = ensure_venv(args.venv)
    env_before = environment()
    results = []
    with tempfile.TemporaryDirectory(prefix="lc-bench-") as tmp:
        for model in args.models.split(","):
            results.append(run_model(model, py, args, Path(tmp)))
    env_after = environment()
    payload = {"environment": env_before, "load_average_after": env_after["load_average_1_5_15"],
               "llmcompressor": LC_VERSION, "samples": args.samples, "windows": args.windows,
               "sentences": args.sentences, "results": results}  # fmt: skip
    cols = [
        ("method", "method"),
        ("weights_bytes", "weight bytes"),
        ("bits_per_weight", "our bits/weight"),
        ("ppl", "perplexity"),
        ("kl", "KL from base"),
        ("one_minus_cos", "1 - cos"),
        ("predicted", "predicted"),
        ("wall_s", "quantize s"),
        ("oneshot_s", "oneshot s"),
    ]
    lines = []
    for r in results:
        lines += [
            f"## Against llm-compressor {LC_VERSION}: {r['model']} (int4 groups of {r['group']})",
            "",
            markdown_table(r["rows"], cols),
            "",
            *[
                f"- {'met' if t['met'] else 'missed'}: {t['target']} ({t['figures']})"
                for t in r["targets"]
            ],
            "",
        ]
    lines.append(
        f"SmolLM2: {args.windows} windows x 512 tokens of news text; MiniLM: the first "
        f"{args.sentences} news sentences. Both GPTQ runs calibrated on {args.samples} windows of "
        "the news text's second half. Every directory loaded by transformers through compressed-tensors "
        f"in float32. Load average {env_before['load_average_1_5_15']} before, "
        f"{env_after['load_average_1_5_15']} after; {env_before['date']}."
    )
    write_results("llmcompressor", payload, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
