"""Quality of the default data-free HIGGS with the table scale search against the exact one.

The default config (`HiggsConfig()`: p=2 n=256, random signs, scale_rule "mse-unbiased")
searches 17 multipliers of each group's RMS scale. `scale_search="exact"` codes every
candidate (the search before the scoring table); the default "table" scores them from one
table lookup per tuple and codes the winner (higgs_engine/scale_search.py). Both run in one
process on the same data as benchmarks/quality.py: SmolLM2-135M, KL(base || quantized) and
perplexity on the first news windows; all-MiniLM-L6-v2, mean 1 - cos on the news sentences.
The speed side is benchmarks/speed.py (interleaved against RTN-4).

Writes benchmarks/results/scale_search.json and .md.

`--sign-seed` runs the default with other random signs (the ablation's seed lottery: does the
table move quality more than a seed does?); `--model` runs one model; `--name` picks the
results stem.

Usage: python -m benchmarks.scale_search [--windows 40] [--sentences 2000] [--threads 1]
           [--model all|smollm2|minilm] [--sign-seed 0] [--name scale_search]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, environment, markdown_table, write_results
from devtools.quality import (
    MINILM_DIR,
    NEWS_FILE,
    EmbeddingEval,
    Method,
    SimulatedModel,
    data_ready,
    higgs_fn,
    load_encoder,
    news_sentences,
    run_methods,
    smollm2_on_news,
)

EXACT = "HIGGS default --bits 4, exact scale search (before)"
TABLE = "HIGGS default --bits 4, table scale search"


def default_method(name: str, sign_seed: int, scale_search: str) -> Method:
    """`higgs quantize --bits 4` (HiggsConfig.from_bits(4) with every default but the seed)."""
    from higgs_engine.planning.config import HiggsConfig

    c = HiggsConfig.from_bits(4.0, sign_seed=sign_seed)
    params: dict[str, Any] = {
        "p": c.p,
        "n": c.n,
        "sign_seed": c.sign_seed,
        "scale_rule": c.scale_rule,
        "scale_search": scale_search,
    }
    fn = higgs_fn(c.p, c.n, c.group_size, c.rotation_block, c.sign_seed, c.scale_rule, scale_search)
    return Method(name, "higgs", params, fn)


def methods(sign_seed: int) -> list[Method]:
    return [
        Method("base", "base", {}),
        default_method(EXACT, sign_seed, "exact"),
        default_method(TABLE, sign_seed, "table"),
    ]


def compare(rows: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    by = {r["method"]: r for r in rows}
    before, after = float(by[EXACT][metric]), float(by[TABLE][metric])
    return {
        "metric": metric,
        "exact": before,
        "table": after,
        "relative_change": after / before - 1.0,
        "within_1pct": after <= before * 1.01,
        "quant_seconds_exact": by[EXACT]["quant_seconds"],
        "quant_seconds_table": by[TABLE]["quant_seconds"],
    }


def to_markdown(p: dict[str, Any]) -> str:
    lines = [
        "### Scale search: table vs exact, default data-free HIGGS (4.08 bits, sign seed "
        f"{p.get('sign_seed', 0)})",
        "",
    ]
    cols = [
        ("model", "model"),
        ("metric", "metric"),
        ("exact", "exact search (before)"),
        ("table", "table search"),
        ("relative_change", "change"),
        ("within_1pct", "within 1%"),
        ("quant_seconds_exact", "quantize s, exact"),
        ("quant_seconds_table", "quantize s, table"),
    ]
    lines.append(markdown_table(p["comparisons"], cols))
    lines.append("")
    for label, rows in p["rows"].items():
        extra = ", ".join(
            f"{r['method']}: "
            + ", ".join(f"{k} {r[k]:.4g}" for k in ("kl", "ppl", "one_minus_cos") if k in r)
            for r in rows
        )
        lines.append(f"- {label}: {extra}")
    env = p["environment"]["start"]
    lines += [
        "",
        f"Measured {env['date']}, torch {env['torch']}, {p['threads']} thread(s), load average "
        f"at start {env['load_average_1_5_15']}, at end "
        f"{p['environment']['end']['load_average_1_5_15']}; {p['seconds']:.0f} s. SmolLM2: "
        f"{p['data']['windows']} news windows of {p['data']['context']} tokens; MiniLM: "
        f"{p['data']['sentences']} news sentences (a model not run has no rows). Quantize "
        "seconds are wall times on a shared machine (noisy); the speed ratio is "
        "benchmarks/speed.py's.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--model", choices=["all", "smollm2", "minilm"], default="all")
    ap.add_argument("--sign-seed", type=int, default=0)
    ap.add_argument("--name", default="scale_search", help="results file stem")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    ok, why = data_ready()
    if not ok:
        print(why, file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    env0 = environment()
    t0 = time.perf_counter()
    rows: dict[str, list[dict[str, Any]]] = {}
    comparisons = []
    if args.model in ("all", "smollm2"):
        _, _, _, ev, _, sim = smollm2_on_news(args.context, args.windows)
        rows["smollm2"] = run_methods(sim, ev, methods(args.sign_seed))
        for metric in ("kl", "ppl"):
            comparisons.append({"model": "smollm2-135m", **compare(rows["smollm2"], metric)})
        del sim, ev
    if args.model in ("all", "minilm"):
        model, tok = load_encoder(MINILM_DIR)
        text = NEWS_FILE.read_text(encoding="utf-8")
        emb = EmbeddingEval(tok, news_sentences(text, args.sentences))
        rows["minilm"] = run_methods(SimulatedModel(model), emb, methods(args.sign_seed))
        comparisons.append(
            {"model": "all-MiniLM-L6-v2", **compare(rows["minilm"], "one_minus_cos")}
        )
    payload = {
        "benchmark": "scale_search",
        "sign_seed": args.sign_seed,
        "data": {"windows": args.windows, "context": args.context, "sentences": args.sentences},
        "threads": torch.get_num_threads(),
        "comparisons": comparisons,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
        "environment": {"start": env0, "end": environment()},
    }
    md = to_markdown(payload)
    j, m = write_results(args.name, payload, md, args.out_dir)
    print(md)
    print(f"wrote {j}, {m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
