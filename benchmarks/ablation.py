"""Ablation of data-free HIGGS choices at 4 bits (p=2, n=256), on the real models.

One run per model, every variant on the same windows / sentences (the quality benchmark's data):
(a) SmolLM2-135M: news text, 40 windows x 512 tokens, KL from base and perplexity;
(b) all-MiniLM-L6-v2: 2000 news sentences, mean 1 - cos of the sentence embeddings.

Variants: random signs before the Hadamard transform (the randomized Hadamard transform) over
three seeds; the scale rule of each group (RMS; the multiplier of the RMS scale minimising the
group's actual reconstruction error; an unbiased rescale that makes the error orthogonal to the
weights; both); the Hadamard block size (256 / 512 / 1024). RTN-4 g128 runs too, as the
reference for "cost of error": KL per unit of relative weight error t^2.

Investigation columns (why HIGGS errors cost more than their t^2 predicts):
- shrink = -<E, W> / ||E||^2 averaged over layers (E = W_hat - W): 1 means the error's
  projection on the weights has the whole error energy's size, i.e. W_hat ~ (1 - t^2) W + noise
  (the shrinkage of an MSE-optimal quantizer); 0 means the error is orthogonal to the weights;
- predicted = sum_l alpha_l t_l^2 with the Fisher alphas of benchmarks/results/
  dynamic_profile_fisher.json (SmolLM2 only), and measured / predicted.

Writes benchmarks/results/ablation_<model>.json and .md.

Usage: python -m benchmarks.ablation [--model smollm2|minilm|all] [--windows 40]
       python -m benchmarks.ablation --merge DIR [DIR ...] [--model smollm2]

Variants are independent: several processes of this script may run disjoint `--only` lists at
the same time into their own --out-dir; `--merge` then joins their rows into one result (only
runs on the same data, whose base figures agree; the result says which runs it joined).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    RESULTS_DIR,
    environment,
    fmt,
    markdown_table,
    write_results,
)
from devtools.quality import (
    ARTIFACT_DTYPE,
    MINILM_DIR,
    NEWS_FILE,
    SMOLLM_DIR,
    CausalLMEval,
    EmbeddingEval,
    SimulatedModel,
    data_ready,
    load_causal_lm,
    load_encoder,
    news_sentences,
    rtn_fn,
)

FISHER_PROFILE = RESULTS_DIR / "dynamic_profile_fisher.json"
SEEDS = (0, 1, 2)


def variant_fn(
    sign_seed: int | None, scale_rule: str, rotation_block: int
) -> Callable[[torch.Tensor], tuple[torch.Tensor, float]]:
    def run(w: torch.Tensor) -> tuple[torch.Tensor, float]:
        from higgs_engine.quantize import MatrixSpec, quantize_matrix_full

        spec = MatrixSpec(
            2, 256, rotation_block=rotation_block, sign_seed=sign_seed, scale_rule=scale_rule
        )
        q, w_hat = quantize_matrix_full(w, spec)
        assert w_hat is not None
        return w_hat, float(q.bits_per_weight())

    return run


def variants() -> list[dict[str, Any]]:
    """(name, group, params): group names the question the variant answers."""
    out: list[dict[str, Any]] = []

    def add(name: str, group: str, seed: int | None, rule: str, block: int = 1024) -> None:
        out.append(
            {
                "name": name,
                "group": group,
                "params": {"sign_seed": seed, "scale_rule": rule, "rotation_block": block},
            }
        )

    add("HIGGS 4.08 (RMS scale, no signs, block 1024)", "baseline", None, "rms")
    add("+ unbiased scale", "scale rule", None, "unbiased")
    add("+ MSE-search scale", "scale rule", None, "mse")
    add("+ MSE-search + unbiased scale", "scale rule", None, "mse-unbiased")
    for s in SEEDS:
        add(f"+ signs seed {s}", "signs", s, "rms")
    add("block 512", "block size", None, "rms", 512)
    add("block 256", "block size", None, "rms", 256)
    for s in SEEDS:
        add(f"+ signs seed {s} + MSE-search + unbiased", "combined", s, "mse-unbiased")
    for s in SEEDS:
        add(f"+ signs seed {s} + unbiased", "combined", s, "unbiased")
    for s in SEEDS:
        add(f"+ signs seed {s} + MSE-search", "combined", s, "mse")
    add("block 256 + MSE-search", "combined", None, "mse", 256)
    return out


def apply(
    sim: SimulatedModel, fn: Callable[[torch.Tensor], tuple[torch.Tensor, float]]
) -> dict[str, Any]:
    """Replace every layer by fn's W_hat (float16 as in the artifact); per-layer statistics."""
    sim.restore()
    per_layer: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for name, mod in sim.layers:
            w = sim.originals[name]
            w_hat, bpw = fn(w)
            w_hat = w_hat.to(ARTIFACT_DTYPE).to(torch.float32)
            e = (w_hat - w).double()
            e2 = float(e.square().sum())
            t2 = e2 / float(w.double().square().sum())
            shrink = float(-(e * w.double()).sum()) / e2 if e2 > 0 else 0.0
            per_layer.append(
                {"name": name, "numel": w.numel(), "bits": bpw, "t2": t2, "shrink": shrink}
            )
            mod.weight.copy_(w_hat.to(mod.weight.dtype))
    total = sum(r["numel"] for r in per_layer)
    return {
        "bits": sum(r["bits"] * r["numel"] for r in per_layer) / total,
        "rel_error": sum(r["t2"] * r["numel"] for r in per_layer) / total,
        "shrink": statistics.fmean(r["shrink"] for r in per_layer),
        "quant_seconds": time.perf_counter() - t0,
        "per_layer": per_layer,
    }


def predicted(per_layer: list[dict[str, Any]], alphas: dict[str, float]) -> float | None:
    if not alphas or any(r["name"] not in alphas for r in per_layer):
        return None
    return sum(alphas[r["name"]] * r["t2"] for r in per_layer)


def summarise(rows: list[dict[str, Any]], metrics: list[str]) -> list[dict[str, Any]]:
    """Mean and spread (min..max, population std) over the seeds of each seeded family."""
    fams: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("params", {}).get("sign_seed") is not None and "error" not in r:
            fam = r["method"].replace(f"seed {r['params']['sign_seed']}", "seeds")
            fams.setdefault(fam, []).append(r)
    out = []
    for fam, rs in fams.items():
        s: dict[str, Any] = {"family": fam, "seeds": [r["params"]["sign_seed"] for r in rs]}
        for m in [*metrics, "rel_error"]:
            v = [float(r[m]) for r in rs]
            s[m] = {
                "mean": statistics.fmean(v),
                "min": min(v),
                "max": max(v),
                "std": statistics.pstdev(v),
            }
        out.append(s)
    return out


def bench(label: str, args: argparse.Namespace) -> dict[str, Any]:
    causal = label == "smollm2"
    text = NEWS_FILE.read_text()
    if causal:
        model, tok = load_causal_lm(SMOLLM_DIR)
        causal_ev = CausalLMEval(tok, text, args.context, args.windows)
        ev: CausalLMEval | EmbeddingEval = causal_ev
        metrics = ["kl", "ppl"]
        data = {
            "text": "data/news.txt",
            "context": args.context,
            "windows": int(causal_ev.windows.shape[0]),
        }
        alphas = (
            {r["name"]: float(r["alpha"]) for r in json.loads(FISHER_PROFILE.read_text())["layers"]}
            if FISHER_PROFILE.is_file()
            else {}
        )
    else:
        model, tok = load_encoder(MINILM_DIR)
        ev = EmbeddingEval(tok, news_sentences(text, args.sentences))
        metrics = ["one_minus_cos"]
        data = {"text": "data/news.txt", "sentences": ev.count}
        alphas = {}
    sim = SimulatedModel(model)
    env = environment()
    t_start = time.perf_counter()
    base = ev.prepare_base(sim.model)
    rows: list[dict[str, Any]] = [{"method": "base", "group": "base", "params": {}, **base}]

    def payload(complete: bool) -> dict[str, Any]:
        return {
            "benchmark": "ablation",
            "model": label,
            "complete": complete,
            "data": data,
            "metrics": metrics,
            "grid": {"p": 2, "n": 256, "group_size": 256},
            "rows": rows,
            "seed_summary": summarise(rows, metrics),
            "alphas": str(FISHER_PROFILE.relative_to(RESULTS_DIR.parent.parent))
            if alphas
            else None,
            "wall_seconds": time.perf_counter() - t_start,
            "environment": {"start": env, "end": environment()},
        }

    todo = [
        {
            "name": "RTN-4 g128",
            "group": "reference",
            "params": {"bits": 4, "group_size": 128},
            "fn": rtn_fn(4),
        }
    ] + [
        {
            **v,
            "fn": variant_fn(
                v["params"]["sign_seed"], v["params"]["scale_rule"], v["params"]["rotation_block"]
            ),
        }
        for v in variants()
    ]
    if args.only:  # exact names, run in the order given
        by_name = {v["name"]: v for v in todo}
        todo = [by_name[n] for n in args.only if n in by_name]
    if args.skip:
        todo = [v for v in todo if not any(v["name"].endswith(s) for s in args.skip)]
    if args.resume:
        earlier = args.out_dir / f"ablation_{label}.json"
        if earlier.is_file():
            old = json.loads(earlier.read_text())
            if old.get("data") == data:  # same windows / sentences: the rows are comparable
                rows[:] = list(old["rows"])
                env = old["environment"]["start"]
                t_start -= float(old.get("wall_seconds", 0.0))
        done = {r["method"] for r in rows}
        todo = [v for v in todo if v["name"] not in done]
    for v in todo:
        st = apply(sim, v["fn"])
        t0 = time.perf_counter()
        res = ev.evaluate(sim.model)
        pred = predicted(st["per_layer"], alphas)
        row = {
            "method": v["name"],
            "group": v["group"],
            "params": v["params"],
            "bits": st["bits"],
            "rel_error": st["rel_error"],
            "shrink": st["shrink"],
            "quant_seconds": st["quant_seconds"],
            "eval_seconds": time.perf_counter() - t0,
            **res,
        }
        m0 = metrics[0]
        row[f"{m0}_per_t2"] = row[m0] / row["rel_error"]
        if pred is not None:
            row["predicted_kl"] = pred
            row["measured_over_predicted"] = row["kl"] / pred
        row["per_layer"] = [{k: r[k] for k in ("name", "t2", "shrink")} for r in st["per_layer"]]
        rows.append(row)
        print(
            f"[{label}] {v['name']:<48} bits={row['bits']:.4f} t2={row['rel_error']:.5f} "
            + " ".join(f"{m}={row[m]:.5g}" for m in metrics)
            + f" shrink={row['shrink']:.3f} q={row['quant_seconds']:.1f}s e={row['eval_seconds']:.0f}s",
            flush=True,
        )
        p = payload(False)
        write_results(f"ablation_{label}", p, to_markdown(p), args.out_dir)
    sim.restore()
    return payload(True)


def to_markdown(p: dict[str, Any]) -> str:
    names = {"kl": "KL", "ppl": "perplexity", "one_minus_cos": "1 - cos"}
    cols = [("method", "variant"), ("bits", "bits/weight"), ("rel_error", "t²")]
    cols += [(m, names[m]) for m in p["metrics"]]
    cols += [(f"{p['metrics'][0]}_per_t2", f"{names[p['metrics'][0]]} / t²"), ("shrink", "shrink")]
    if any("predicted_kl" in r for r in p["rows"]):
        cols += [
            ("predicted_kl", "predicted KL (Fisher)"),
            ("measured_over_predicted", "measured / predicted"),
        ]
    cols += [("quant_seconds", "quant. s")]
    d = p["data"]
    desc = (
        f"{d['windows']} windows x {d['context']} tokens"
        if "windows" in d
        else f"{d['sentences']} sentences"
    )
    lines = [f"### Ablation of data-free HIGGS p=2 n=256: {p['model']} ({desc} of news text)", ""]
    if not p["complete"]:
        lines += ["**PARTIAL: the run was still going when this was written.**", ""]
    if p.get("merged_runs"):
        lines += [
            f"Rows of {len(p['merged_runs'])} processes of this script that ran side by side on "
            "the same windows (identical base figures), joined with --merge.",
            "",
        ]
        if p.get("not_run"):
            lines += ["Not run in this result: " + "; ".join(p["not_run"]) + ".", ""]
    lines += [markdown_table(p["rows"], cols), ""]
    if p["seed_summary"]:
        lines += ["Random signs, over seeds (mean, min..max, std):", ""]
        for s in p["seed_summary"]:
            parts = [
                f"{names.get(m, m)} {fmt(s[m]['mean'])} ({fmt(s[m]['min'])}..{fmt(s[m]['max'])}, std {fmt(s[m]['std'])})"
                for m in p["metrics"]
            ]
            lines.append(f"- {s['family']} (seeds {s['seeds']}): " + "; ".join(parts))
        lines.append("")
    env = p["environment"]["start"]
    lines.append(
        f"Measured {env['date']}, torch {env['torch']}, {env['torch_threads']} thread(s), load average "
        f"at start {env['load_average_1_5_15']}; {p['wall_seconds']:.0f} s."
    )
    return "\n".join(lines)


def merge(label: str, dirs: list[Path], out_dir: Path) -> dict[str, Any]:
    """One result from the rows of runs on the same data (first run's row wins on a repeat)."""
    runs = [json.loads((d / f"ablation_{label}.json").read_text()) for d in dirs]
    first = runs[0]
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for r in runs:
        if r["data"] != first["data"]:
            raise SystemExit(
                f"{label}: runs measured different data: {r['data']} vs {first['data']}"
            )
        base = next(x for x in r["rows"] if x["method"] == "base")
        base0 = next(x for x in first["rows"] if x["method"] == "base")
        # the same model on the same data; thread counts change only the last digits
        if any(not math.isclose(base[m], base0[m], rel_tol=1e-5) for m in first["metrics"]):
            raise SystemExit(f"{label}: base figures differ between runs: {base} vs {base0}")
        for row in r["rows"]:
            if row["method"] not in seen:
                seen.add(row["method"])
                rows.append(row)
    order = {v["name"]: i for i, v in enumerate(variants())}
    rows.sort(
        key=lambda x: (
            x["method"] != "base",
            x["method"] != "RTN-4 g128",
            order.get(x["method"], -1),
        )
    )
    p = {
        **first,
        "complete": True,  # every joined row is a finished measurement; not_run lists the rest
        "not_run": [v["name"] for v in variants() if v["name"] not in seen],
        "rows": rows,
        "seed_summary": summarise(rows, first["metrics"]),
        "wall_seconds": max(float(r["wall_seconds"]) for r in runs),
        "merged_runs": [
            {
                "dir": str(d),
                "rows": [x["method"] for x in r["rows"]],
                "environment": r["environment"],
            }
            for d, r in zip(dirs, runs, strict=True)
        ],
    }
    write_results(f"ablation_{label}", p, to_markdown(p), out_dir)
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ablation of data-free HIGGS choices at 4 bits")
    ap.add_argument("--model", choices=["smollm2", "minilm", "all"], default="all")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--only", nargs="*", help="run only these variants (exact names), in this order"
    )
    ap.add_argument(
        "--resume", action="store_true", help="keep the rows of an earlier run on the same data"
    )
    ap.add_argument("--skip", nargs="*", help="skip variants whose name ends with one of these")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument(
        "--merge", nargs="+", type=Path, metavar="DIR", help="join the rows of these runs' results"
    )
    args = ap.parse_args(argv)
    if args.merge:
        for label in ("minilm", "smollm2"):
            if args.model in (label, "all") and all(
                (d / f"ablation_{label}.json").is_file() for d in args.merge
            ):
                print(to_markdown(merge(label, args.merge, args.out_dir)), flush=True)
        return 0
    torch.set_num_threads(args.threads)
    ok, why = data_ready()
    if not ok:
        print(why, file=sys.stderr)
        return 2
    for label in ("minilm", "smollm2"):
        if args.model in (label, "all"):
            p = bench(label, args)
            md = to_markdown(p)
            write_results(f"ablation_{label}", p, md, args.out_dir)
            print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
