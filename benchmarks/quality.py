"""Quality benchmark: every competitor on the same real model, on the same windows / sentences.

(a) SmolLM2-135M-Instruct: every nn.Linear except lm_head; news text, context 512, 40 windows;
    perplexity and KL(base || quantized) (base log-probs computed once).
(b) all-MiniLM-L6-v2: every nn.Linear; 2000 news sentences; mean 1 - cosine between base and
    quantized sentence embeddings (mean pooling, L2-normalised).

Each method is applied layer by layer to an in-memory copy of the model's linear weights
(W -> W_hat, rounded to float16 as in the dequantized artifact), so every method sees identical
weights. The real pipeline (`quantize_checkpoint`, HIGGS p=2 n=256, dequantized artifact) is
also run once and evaluated on the same data, to check it matches the simulated figure.

Writes benchmarks/results/quality_<model>.json, .md and .png.

Usage: python -m benchmarks.quality [--model smollm2|minilm|all] [--windows 40] [--sentences 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    RESULTS_DIR,
    environment,
    fmt,
    markdown_table,
    plot_bits_vs_metric,
    write_results,
)
from devtools.calibrated import calibrated_methods, calibration_split
from devtools.quality import (
    MINILM_DIR,
    NEWS_FILE,
    SMOLLM_DIR,
    CausalLMEval,
    EmbeddingEval,
    Method,
    SimulatedModel,
    all_methods,
    data_ready,
    load_causal_lm,
    load_encoder,
    news_sentences,
    run_methods,
    select_methods,
)
from higgs_engine.calibration import DEFAULT_CALIBRATION_TOKENS

# The quality targets: (winner, loser) pairs, checked on every model.
TARGETS = [
    ("HIGGS p=2 n=256", "RTN-4 g128"),
    ("HIGGS p=2 n=64", "HQQ-3 g64"),
    ("HIGGS p=2 n=64", "RTN-3 g128"),
    ("HIGGS p=2 n=512", "NF4 b64"),
    ("HIGGS p=2 n=512", "HQQ-4 g64"),
    ("calibrated HIGGS p=2 n=256", "GPTQ int4 g128"),
    ("calibrated HIGGS p=2 n=256", "HIGGS p=2 n=256"),
    ("calibrated dynamic HIGGS 3.5 bits", "NF4 b64"),
]
REAL_PATH_METHOD = "HIGGS p=2 n=256"
DYNAMIC_BITS = 4.13  # NF4 with double quantization's size
# The engine's default data-free profile: Fisher on self-generated text for a causal LM, the
# Gauss-Newton cos profile on random [CLS] ... [SEP] windows for an encoder.
DYNAMIC_METHOD = f"dynamic HIGGS {DYNAMIC_BITS} (default profile)"
TARGETS += [
    ("HIGGS default --bits 4", "RTN-4 g128"),
    (DYNAMIC_METHOD, "NF4 b64 dq"),
    (DYNAMIC_METHOD, "HQQ-4 g64"),
]


def dynamic_method(
    model_dir: Path, sim: SimulatedModel, cache_dir: Path | None
) -> tuple[Method, dict[str, Any]]:
    """Dynamic HIGGS at DYNAMIC_BITS as `higgs quantize SRC --avg-bits` runs it with no text:
    the default profile (cached in `cache_dir`; for a causal LM Fisher/KL on text the model
    generates itself, for an encoder Gauss-Newton/cos on random framed tokens), the DP
    allocation, and each layer's grid with the default HiggsConfig."""
    from devtools.profiles import get_profile
    from higgs_engine.planning.config import HiggsConfig
    from higgs_engine.planning.plans import Target, plan_allocation
    from higgs_engine.planning.profile import DEFAULT_PROFILE
    from higgs_engine.quantize import dequantize_matrix, quantize_matrix

    t0 = time.perf_counter()
    prof = get_profile(model_dir, DEFAULT_PROFILE, cache_dir=cache_dir)
    profile_s = time.perf_counter() - t0
    cfg = HiggsConfig()
    names = [n for n, _ in sim.layers]
    plan = plan_allocation(prof, cfg, Target(avg_bits=DYNAMIC_BITS), names=names)
    grids = {o.name: (o.p, o.n) for o in plan.allocation.overrides()}
    by_id = {id(w): n for n, w in sim.originals.items()}

    def run(w: torch.Tensor) -> tuple[torch.Tensor, float]:
        p, n = grids[by_id[id(w)]]
        if p == 0:
            return w.clone(), 16.0
        q = quantize_matrix(w, cfg.matrix_spec((p, n)))
        return dequantize_matrix(q), float(q.bits_per_weight())

    info = {
        "profile_seconds": profile_s,
        "profile_cost": prof.cost,
        "profile_calibration": prof.calibration,
        "profile_config": prof.config,
        "allocator_avg_bits": plan.allocation.avg_bits,
        "histogram": plan.allocation.histogram(),
    }
    params = {"avg_bits": DYNAMIC_BITS, "profile": prof.calibration, "method": prof.method}
    return Method(DYNAMIC_METHOD, "dynamic", params, run), info


def check_targets(rows: list[dict[str, Any]], metrics: list[str]) -> list[dict[str, Any]]:
    """For each target pair present in `rows`: is the winner's metric lower, metric by metric."""
    by = {r["method"]: r for r in rows}
    out = []
    for win, lose in TARGETS:
        if win not in by or lose not in by or "error" in by[win] or "error" in by[lose]:
            continue
        for m in metrics:
            a, b = by[win].get(m), by[lose].get(m)
            out.append(
                {
                    "winner": win,
                    "loser": lose,
                    "metric": m,
                    "winner_value": a,
                    "loser_value": b,
                    "winner_bits": by[win]["bits"],
                    "loser_bits": by[lose]["bits"],
                    "met": a is not None and b is not None and a < b,
                }
            )
    return out


def real_path(
    model_dir: Path, evaluator: CausalLMEval | EmbeddingEval, causal: bool
) -> dict[str, Any]:
    """quantize_checkpoint (HIGGS p=2 n=256, dequantized artifact) evaluated on the same data."""
    from higgs_engine.pipeline import quantize_checkpoint
    from higgs_engine.planning.config import HiggsConfig

    cfg = HiggsConfig(p=2, n=256, formats=("dequantized",))
    with tempfile.TemporaryDirectory(prefix="higgs-quality-") as tmp:
        out = Path(tmp) / "out"
        t0 = time.perf_counter()
        report = quantize_checkpoint(model_dir, out, cfg)
        seconds = time.perf_counter() - t0
        loader = load_causal_lm if causal else load_encoder
        model, _ = loader(out / "dequantized")
        metrics = evaluator.evaluate(model)
        del model
    quantized = [row for row in report.layers if row.p]
    total = sum(row.shape[0] * row.shape[1] for row in quantized)
    return {
        "method": f"{REAL_PATH_METHOD} (quantize_checkpoint, dequantized artifact)",
        "config": cfg.to_dict(),
        "pipeline_seconds": seconds,
        "report_bits_per_weight": report.bits_per_weight,
        "report_bits_per_param_total": report.bits_per_param_total,
        "report_layers_quantized": len(quantized),
        "report_rel_error": sum(r.rel_error * r.shape[0] * r.shape[1] for r in quantized)
        / max(total, 1),
        **metrics,
    }


def bench_model(
    label: str, model_dir: Path, causal: bool, args: argparse.Namespace
) -> dict[str, Any]:
    text = NEWS_FILE.read_text()
    t_load = time.perf_counter()
    if causal:
        model, tok = load_causal_lm(model_dir)
        causal_eval = CausalLMEval(tok, text, args.context, args.windows)
        evaluator: CausalLMEval | EmbeddingEval = causal_eval
        data = {
            "text": "data/news.txt (gensim lee_background.cor)",
            "context": args.context,
            "windows": int(causal_eval.windows.shape[0]),
        }
        metrics = ["kl", "ppl"]
        cal_data = calibration_split(
            tok, text, int(causal_eval.windows.numel()), args.calibration_tokens, args.context
        )
    else:
        model, tok = load_encoder(model_dir)
        evaluator = EmbeddingEval(tok, news_sentences(text, args.sentences))
        data = {
            "text": "data/news.txt (gensim lee_background.cor)",
            "sentences": evaluator.count,
            "pooling": "mean over attention mask, L2-normalised",
        }
        metrics = ["one_minus_cos"]
        # Calibration: the text after the last evaluation sentence, windows of 128 tokens.
        sents = news_sentences(text, args.sentences)
        offset = text.find(sents[-1]) + len(sents[-1])
        cal_data = calibration_split(
            tok,
            text[offset:],
            0,
            args.calibration_tokens,
            128,
            where=f"data/news.txt after character {offset} (the last evaluation sentence)",
        )
    data["calibration"] = cal_data.description
    sim = SimulatedModel(model)
    print(
        f"[{label}] {len(sim.layers)} linear layers, {sim.weights / 1e6:.1f}M weights; "
        f"loaded in {time.perf_counter() - t_load:.1f}s; data {data}",
        flush=True,
    )
    env_before = environment()
    t0 = time.perf_counter()

    def payload(
        rows: list[dict[str, Any]], real: dict[str, Any] | None, complete: bool
    ) -> dict[str, Any]:
        return {
            "benchmark": "quality",
            "model": label,
            "complete": complete,
            "model_dir": str(model_dir.relative_to(model_dir.parent.parent)),
            "data": data,
            "metrics": metrics,
            "rows": rows,
            "real_path": real,
            "targets": check_targets(rows, metrics),
            "wall_seconds": time.perf_counter() - t0,
            "environment": {"start": env_before, "end": environment()},
            "notes": "simulated quantization: each method applied layer by layer to the same "
            "in-memory weights (W_hat rounded to float16). Quantization seconds measured on a "
            "shared 2-core machine (noisy); see benchmarks/speed.py for the timing benchmark.",
        }

    methods = select_methods(
        [m for m in (args.methods or []) if m != DYNAMIC_METHOD] or None,
        calibrated_methods(model_dir, cal_data),
    )
    dyn_info: dict[str, Any] | None = None
    if not args.methods or DYNAMIC_METHOD in args.methods:
        dyn, dyn_info = dynamic_method(model_dir, sim, args.profile_cache)
        print(f"[{label}] dynamic profile: {dyn_info}", flush=True)
        methods.append(dyn)
    data["dynamic"] = dyn_info
    kept = reused_rows(args.reuse, label, data, {m.name for m in methods}) if args.reuse else []

    def save_partial(rows: list[dict[str, Any]]) -> None:
        # partial results are on disk after every method ("complete": false until the end)
        save(payload(kept + rows, None, False), args.out_dir)

    rows = kept + run_methods(
        sim,
        evaluator,
        methods,
        log=lambda s: print(f"[{label}] {s}", flush=True),
        keep_going=True,
        on_row=save_partial,
    )
    real = None
    if not args.no_real_path:
        del sim, model
        save(payload(rows, None, False), args.out_dir)
        real = real_path(model_dir, evaluator, causal)
        print(f"[{label}] real path: {real}", flush=True)
    return payload(rows, real, True)


def reused_rows(
    path: Path, label: str, data: dict[str, Any], running: set[str]
) -> list[dict[str, Any]]:
    """Rows of an earlier run of this script on the same data, for the methods not run now.

    Every method here is deterministic (same weights, same windows, same code: the same
    figures), so a long table can be completed without re-measuring what did not change; each
    kept row names the run it comes from. Refuses a run on other data."""
    old = json.loads(path.read_text())
    same = ("text", "context", "windows", "sentences")
    if old.get("model") != label or any(old["data"].get(k) != data.get(k) for k in same):
        raise SystemExit(f"{path}: not a {label} run on the same data ({old.get('data')})")
    when = old["environment"]["start"]["date"]
    return [
        {**r, "reused_from": r.get("reused_from", when)}
        for r in old["rows"]
        if r["method"] not in running and r["method"] != "base" and "error" not in r
    ]


def save(p: dict[str, Any], out_dir: Path) -> str:
    """Write quality_<model>.json / .md / .png; return the markdown."""
    label = p["model"]
    md = to_markdown(p)
    metric = p["metrics"][0]
    base = next((r.get(metric) for r in p["rows"] if r["family"] == "base"), None)
    plot_bits_vs_metric(
        [r for r in p["rows"] if "error" not in r],
        metric,
        f"{label}: bits vs {metric} (lower is better)",
        out_dir / f"quality_{label}.png",
        base_value=base if base else None,
    )
    md += f"\n\n![bits vs {metric}](quality_{label}.png)\n"
    write_results(f"quality_{label}", p, md, out_dir)
    return md


def to_markdown(p: dict[str, Any]) -> str:
    metric_cols = {"kl": "KL from base", "ppl": "perplexity", "one_minus_cos": "1 - cos"}
    cols = [("method", "method"), ("bits", "bits/weight"), ("rel_error", "rel. weight error t²")]
    cols += [
        (m, metric_cols[m]) for m in (["ppl", "kl"] if "ppl" in p["metrics"] else p["metrics"])
    ]
    cols += [("quant_seconds", "quant. s")]
    if any("peak_rss_mib" in r for r in p["rows"]):  # results from before these were recorded
        cols += [("quant_cpu_seconds", "quant. CPU s"), ("peak_rss_mib", "peak RSS MiB")]
    d = p["data"]
    desc = (
        f"{d['windows']} windows x {d['context']} tokens of news text"
        if "windows" in d
        else f"{d['sentences']} news sentences"
    )
    lines = [f"### Quality: {p['model']} ({desc})", ""]
    if not p.get("complete", True):
        lines += ["**PARTIAL: the run was still going when this was written.**", ""]
    order = {m.name: i for i, m in enumerate(all_methods())}
    rows = sorted(p["rows"], key=lambda r: order.get(r["method"], len(order)))
    reused = sorted({r["reused_from"] for r in rows if r.get("reused_from")})
    rows = [{**r, "method": r["method"] + " †"} if r.get("reused_from") else r for r in rows]
    lines += [markdown_table(rows, cols), ""]
    if reused:
        lines += [
            "† measured by this script's run of "
            + ", ".join(reused)
            + " on the same windows with the same code (the methods are deterministic); kept "
            "with --reuse, the other rows measured in this run.",
            "",
        ]
    failed = [r for r in p["rows"] if "error" in r]
    lines += [f"- {r['method']} FAILED: {r['error']}" for r in failed] + ([""] if failed else [])
    if p.get("real_path"):
        r = p["real_path"]
        sim = next((x for x in p["rows"] if x["method"] == REAL_PATH_METHOD), None)
        figs = ", ".join(
            f"{metric_cols[m]} {fmt(r.get(m))}" + (f" (simulated {fmt(sim.get(m))})" if sim else "")
            for m in p["metrics"]
        )
        lines += [
            f"Real pipeline check, `quantize_checkpoint` {REAL_PATH_METHOD} -> dequantized artifact: {figs}; "
            f"report bits/weight {fmt(r['report_bits_per_weight'])}, whole checkpoint "
            f"{fmt(r['report_bits_per_param_total'])} bits/param, pipeline {r['pipeline_seconds']:.1f} s.",
            "",
        ]
    if p["targets"]:
        lines += ["Targets (lower is better):", ""]
        for t in p["targets"]:
            mark = "met" if t["met"] else "NOT met"
            lines.append(
                f"- {t['winner']} ({fmt(t['winner_bits'])} bits) vs {t['loser']} ({fmt(t['loser_bits'])} bits), "
                f"{metric_cols[t['metric']]}: {fmt(t['winner_value'])} vs {fmt(t['loser_value'])}: **{mark}**"
            )
        lines.append("")
    env = p["environment"]["start"]
    lines.append(
        f"Measured {env['date']}, torch {env['torch']}, {env['torch_threads']} threads, "
        f"load average at start {env['load_average_1_5_15']} (shared machine: seconds are noisy)."
    )
    before = [r["rss_before_mib"] for r in p["rows"] if r.get("rss_before_mib")]
    if before:
        lines.append(
            "Peak RSS: the benchmark process's peak while the method ran (VmHWM reset before "
            f"each method), which includes the {min(before):.0f}-{max(before):.0f} MiB it "
            "already held (model, evaluation data); benchmarks/calibrated_cost.py measures "
            "data-free vs calibrated peaks in fresh processes."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="HIGGS vs RTN / NF4 / HQQ quality on real models")
    ap.add_argument("--model", choices=["smollm2", "minilm", "all"], default="all")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--methods", nargs="*", help="subset of method names (default: all)")
    ap.add_argument(
        "--calibration-tokens",
        type=int,
        default=DEFAULT_CALIBRATION_TOKENS,
        help="tokens of news text (after the evaluation data) for the calibrated methods",
    )
    ap.add_argument(
        "--no-real-path", action="store_true", help="skip the quantize_checkpoint check"
    )
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument(
        "--reuse",
        type=Path,
        metavar="JSON",
        help="keep the rows of this earlier run (same model and data) for the methods not run now",
    )
    ap.add_argument(
        "--profile-cache",
        type=Path,
        default=None,
        help="profile / self-generated text cache of the dynamic method (default: none, measured)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0 = torch's default). On the shared 2-core machine 1 thread ran "
        "HQQ 5x and the model 3x faster than 2 contended threads.",
    )
    ap.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="only re-render the markdown and plot of an earlier run's JSON (measures nothing)",
    )
    args = ap.parse_args(argv)
    if args.render:
        print(save(json.loads(args.render.read_text()), args.out_dir))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    ok, why = data_ready()
    if not ok:
        print(why, file=sys.stderr)
        return 2
    torch.manual_seed(0)
    jobs = [("smollm2", SMOLLM_DIR, True), ("minilm", MINILM_DIR, False)]
    for label, path, causal in jobs:
        if args.model not in (label, "all"):
            continue
        md = save(bench_model(label, path, causal, args), args.out_dir)
        print(md)
        print(f"wrote {args.out_dir}/quality_{label}.json, .md, .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
