"""How many documents does a data-free profile need? Predicted vs measured KL over subsets.

One run on SmolLM2-135M. The default profile's self-generated text (16 sequences of 512 tokens,
seed 0, as `higgs quantize --avg-bits` samples it) and 16 windows of held-out news text (after
the quality benchmark's 40 evaluation windows) are profiled one window at a time (Fisher
method, 4 label draws per window), so a profile on any subset of windows is the mean of its
windows' alphas. Three allocations are applied in memory (HIGGS with the default HiggsConfig,
W_hat rounded to float16) and measured on the first 8 news windows (KL from the base model):
uniform p=2 n=256 (`--bits 4`) and dynamic HIGGS at 4.13 bits planned from all 16 self windows
and from all 16 news windows. For k = 2, 4, 8 and 16 windows, 200 seeded random subsets of each
source give the predicted KL (sum over layers of alpha_l * measured t_l^2) over the measured
one: mean, standard deviation, range and the share within 20%.

Writes benchmarks/results/profile_documents.json and .md.

    python -m benchmarks.profile_documents [--threads 1] [--subsets 200] [--eval-windows 8]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, environment, fmt, markdown_table, write_results
from benchmarks.datafree_sources import HELD_OUT_FROM, quantize_alloc
from devtools.quality import (
    SMOLLM_DIR,
    data_ready,
    load_causal_lm,
    smollm2_on_news,
)
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.planning.plans import Target, plan_allocation
from higgs_engine.planning.profile import DEFAULT_PROFILE, LayerAlpha, Profile

SUBSET_SIZES = (2, 4, 8, 16)
WINDOW_DRAWS = 4  # label draws per single-window profile


def mean_alphas(windows: list[dict[str, float]]) -> dict[str, float]:
    return {n: math.fsum(w[n] for w in windows) / len(windows) for n in windows[0]}


def as_profile(alphas: dict[str, float], shapes: dict[str, list[int]]) -> Profile:
    """A complete Profile with these alphas (what the allocator reads)."""
    return Profile(
        model="smollm2",
        revision=None,
        calibration="mean of windows",
        config=replace(DEFAULT_PROFILE, metric="kl").to_dict(),
        layers=[LayerAlpha(n, shapes[n], a, [], None) for n, a in alphas.items()],
        base={},
        cost={},
        complete=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--subsets", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from higgs_engine.evaluate import text_windows, tokenize
    from higgs_engine.planning.profile import ProfileRequest
    from higgs_engine.profile import ProfileRun, compute_profile
    from higgs_engine.selfgen import SelfGenConfig, self_generated_tokens

    env = environment()
    t_run = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_run:7.1f}s] {msg}", flush=True)

    ok, why = data_ready()
    if not ok:
        print(why, file=sys.stderr)
        return 2
    _model, tok, text, ev, base, sim = smollm2_on_news(DEFAULT_PROFILE.context, args.eval_windows)
    names = [n for n, _ in sim.layers]
    shapes = {n: list(sim.originals[n].shape) for n in names}
    float_model, _ = load_causal_lm(SMOLLM_DIR)
    float_model = float_model.float()

    n_win = DEFAULT_PROFILE.windows
    sg = SelfGenConfig(count=n_win, length=DEFAULT_PROFILE.context, seed=DEFAULT_PROFILE.seed)
    self_wins = self_generated_tokens(float_model, tok, sg)
    log(f"generated {n_win} self-generated sequences")
    held = tokenize(tok, text)[HELD_OUT_FROM * DEFAULT_PROFILE.context :]
    real_wins = text_windows(held, DEFAULT_PROFILE.context, n_win)
    per: dict[str, list[dict[str, float]]] = {"self": [], "real": []}
    ppl: dict[str, list[float]] = {"self": [], "real": []}
    one = replace(DEFAULT_PROFILE, windows=1, fisher_samples=WINDOW_DRAWS)
    for source, wins in (("self", self_wins), ("real", real_wins)):
        for i in range(int(wins.shape[0])):
            request = ProfileRequest("smollm2", None, f"{source}:{i}", one, tuple(names))
            prof = compute_profile(float_model, ProfileRun(request), wins[i : i + 1])
            per[source].append(prof.alphas())
            ppl[source].append(float(prof.base["ppl"]))
            log(f"{source} window {i}: base perplexity {ppl[source][-1]:.2f}")
    del float_model

    hcfg = HiggsConfig()
    cache: dict[Any, Any] = {}
    allocations: dict[str, dict[str, tuple[int, int] | None]] = {
        "uniform p=2 n=256": dict.fromkeys(names, (2, 256))
    }
    for source in ("self", "real"):
        plan = plan_allocation(
            as_profile(mean_alphas(per[source]), shapes),
            hcfg,
            Target(avg_bits=4.13),
            names=names,
        )
        allocations[f"dynamic 4.13 from all {source} windows"] = {
            o.name: (None if o.p == 0 else (o.p, o.n)) for o in plan.allocation.overrides()
        }
    measured: dict[str, dict[str, Any]] = {}
    for label, grids in allocations.items():
        t2s, bits = quantize_alloc(sim, grids, hcfg, cache)
        got = ev.evaluate(sim.model)
        sim.restore()
        measured[label] = {"bits": bits, "kl": got["kl"], "ppl": got["ppl"], "t2": t2s}
        log(f"{label}: bits {bits:.4f} KL {got['kl']:.4f}")

    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    for label, m in measured.items():
        for source in ("self", "real"):
            for k in SUBSET_SIZES:
                draws = 1 if k == n_win else args.subsets
                ratios = []
                for _ in range(draws):
                    sub = per[source] if k == n_win else rng.sample(per[source], k)
                    a = mean_alphas(sub)
                    pred = math.fsum(max(0.0, a[n]) * t for n, t in m["t2"].items())
                    ratios.append(pred / m["kl"])
                rows.append(
                    {
                        "allocation": label,
                        "source": source,
                        "windows": k,
                        "subsets": draws,
                        "mean": statistics.fmean(ratios),
                        "sd": statistics.pstdev(ratios),
                        "min": min(ratios),
                        "max": max(ratios),
                        "within_20pct": sum(abs(r - 1) <= 0.2 for r in ratios) / len(ratios),
                    }
                )
    res = {
        "benchmark": "profile_documents",
        "model": "smollm2",
        "eval": {"text": "data/news.txt", "windows": args.eval_windows},
        "base": base,
        "window_draws": WINDOW_DRAWS,
        "selfgen": sg.to_dict(),
        "window_ppl": ppl,
        "measured": {k: {x: v for x, v in m.items() if x != "t2"} for k, m in measured.items()},
        "rows": rows,
        "alphas": per,
        "wall_seconds": time.perf_counter() - t_run,
        "environment": {"start": env, "end": environment()},
    }
    write_results("profile_documents", res, to_markdown(res), args.out_dir)
    print(to_markdown(res))
    return 0


def to_markdown(res: dict[str, Any]) -> str:
    sp = res["window_ppl"]["self"]
    rp = res["window_ppl"]["real"]
    lines = [
        "### How many documents a data-free profile needs (SmolLM2-135M)",
        "",
        f"Per-window Fisher alphas ({res['window_draws']} label draws per window) on "
        f"{len(sp)} self-generated sequences (the default profile's text) and {len(rp)} held-out "
        f"news windows; a profile on k windows is the mean of their alphas. Predicted KL (sum "
        f"alpha_l t_l^2) over the KL measured on {res['eval']['windows']} news windows "
        f"(base perplexity {fmt(res['base']['ppl'])}), over random subsets of k windows.",
        "",
        "Base perplexity per window: self-generated "
        + ", ".join(f"{x:.1f}" for x in sp)
        + "; news "
        + ", ".join(f"{x:.1f}" for x in rp)
        + ".",
        "",
        markdown_table(
            [{"label": k, **v} for k, v in res["measured"].items()],
            [("label", "allocation"), ("bits", "bits/weight"), ("kl", "KL"), ("ppl", "perplexity")],
        ),
        "",
        markdown_table(
            res["rows"],
            [
                ("allocation", "allocation"),
                ("source", "profile text"),
                ("windows", "windows (k)"),
                ("subsets", "subsets"),
                ("mean", "predicted / measured, mean"),
                ("sd", "sd"),
                ("min", "min"),
                ("max", "max"),
                ("within_20pct", "share within 20%"),
            ],
        ),
        "",
    ]
    env = res["environment"]["start"]
    lines.append(
        f"Measured {env['date']}, torch {env['torch']}, {env['torch_threads']} thread(s), load "
        f"average at start {env['load_average_1_5_15']}; {res['wall_seconds']:.0f} s."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
