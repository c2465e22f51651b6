"""Which tokens should a data-free profile use? Random tokens vs self-generated text vs real text.

One run on SmolLM2-135M: three Fisher profiles (KL metric, the engine's default profile
settings: 4 windows x 512 tokens, 4 label draws per window) that differ only in their tokens:
- random: seeded uniform random token ids (the old data-free default);
- self: text the model generates itself (higgs_engine.selfgen, the new data-free default);
- real: news text held out from the evaluation (the windows after the first 40).
Each profile drives the dynamic allocator at 4.13 bits (NF4 with double quantization's size)
and 3.5 bits; every allocation is applied to the model in memory (HIGGS with the engine's default
HiggsConfig, W_hat rounded to float16) and evaluated on the same first news windows: KL from the
base model and perplexity. Also reported: the profile's predicted KL (sum alpha_l t_l^2) against
the measured one, and each profile's cost (generation included for "self").

Writes benchmarks/results/datafree_sources.json and .md.

    python benchmarks/datafree_sources.py [--eval-windows 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, environment, fmt, markdown_table, write_results  # noqa: E402
from devtools.quality import (  # noqa: E402
    ARTIFACT_DTYPE,
    NEWS_FILE,
    SMOLLM_DIR,
    CausalLMEval,
    SimulatedModel,
    load_causal_lm,
)
from higgs_engine.dynamic import DEFAULT_PROFILE, Target, plan_allocation  # noqa: E402
from higgs_engine.planning.config import HiggsConfig  # noqa: E402
from higgs_engine.profile import Profile  # noqa: E402

BUDGETS = (4.13, 3.5)
HELD_OUT_FROM = 40  # real-text profile windows start after the quality benchmark's 40 windows


def quantize_alloc(
    sim: SimulatedModel,
    grids: dict[str, tuple[int, int] | None],
    cfg: HiggsConfig,
    cache: dict[Any, Any],
) -> tuple[dict[str, float], float]:
    """Apply each layer's grid (None = keep 16-bit); per-layer t^2 and bits per weight."""
    from higgs_engine.quantize import quantize_matrix_full

    t2s: dict[str, float] = {}
    bits = 0.0
    with torch.no_grad():
        for name, mod in sim.layers:
            w = sim.originals[name]
            g = grids[name]
            if g is None:
                mod.weight.copy_(w.to(ARTIFACT_DTYPE).to(mod.weight.dtype))
                t2s[name] = 0.0
                bits += 16 * w.numel()
                continue
            key = (name, g)
            if key not in cache:
                q, w_hat = quantize_matrix_full(
                    w,
                    *g,
                    group_size=cfg.group_size,
                    rotation_block=cfg.rotation_block,
                    sign_seed=cfg.sign_seed,
                    scale_rule=cfg.scale_rule,
                )
                assert w_hat is not None
                w_hat = w_hat.to(ARTIFACT_DTYPE)
                t2 = float((w_hat.float() - w).double().square().sum() / w.double().square().sum())
                cache[key] = (w_hat, t2, float(q.bits_per_weight()))
            w_hat, t2, bpw = cache[key]
            mod.weight.copy_(w_hat.to(mod.weight.dtype))
            t2s[name] = t2
            bits += bpw * w.numel()
    return t2s, bits / sim.weights


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument(
        "--profile-cache",
        type=Path,
        default=None,
        help="the engine's profile cache (shared with quality.py)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    env = environment()
    t_run = time.perf_counter()
    model, tok = load_causal_lm(SMOLLM_DIR)
    text = NEWS_FILE.read_text(encoding="utf-8")
    ev = CausalLMEval(tok, text, args.context, args.eval_windows)
    base = ev.prepare_base(model)
    sim = SimulatedModel(model)
    names = [n for n, _ in sim.layers]
    hcfg = HiggsConfig()
    pcfg = DEFAULT_PROFILE
    res: dict[str, Any] = {
        "benchmark": "datafree_sources",
        "model": "smollm2",
        "eval": {
            "text": "data/news.txt",
            "windows": int(ev.windows.shape[0]),
            "context": args.context,
        },
        "base": base,
        "profile_config": pcfg.to_dict(),
        "higgs_config": {k: v for k, v in hcfg.to_dict().items() if k != "overrides"},
        "profiles": {},
        "runs": [],
        "environment": {"start": env},
    }

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_run:7.1f}s] {msg}", flush=True)

    def save() -> None:
        res["wall_seconds"] = time.perf_counter() - t_run
        res["environment"]["end"] = environment()
        write_results("datafree_sources", res, to_markdown(res), args.out_dir)

    from higgs_engine.evaluate import tokenize

    log(f"base ppl {base['ppl']:.3f}")
    cache: dict[Any, Any] = {}

    def run_budgets(source: str, prof: Profile) -> None:
        for budget in BUDGETS:
            plan = plan_allocation(prof, hcfg, Target(avg_bits=budget), names=names)
            grids = {
                o.name: (None if o.p == 0 else (o.p, o.n)) for o in plan.allocation.overrides()
            }
            t2s, bits = quantize_alloc(sim, grids, hcfg, cache)
            m = ev.evaluate(sim.model)
            pred = math.fsum(max(0.0, prof.alphas()[n]) * t for n, t in t2s.items())
            res["runs"].append(
                {
                    "source": source,
                    "target_bits": budget,
                    "bits": bits,
                    "allocator_bits": plan.allocation.avg_bits,
                    "kl": m["kl"],
                    "ppl": m["ppl"],
                    "predicted_kl": pred,
                    "predicted_over_measured": pred / m["kl"] if m["kl"] else None,
                    "grids": {n: (list(g) if g else None) for n, g in grids.items()},
                }
            )
            log(
                f"{source} @{budget}: bits {bits:.4f} KL {m['kl']:.4f} ppl {m['ppl']:.3f} predicted {pred:.4f}"
            )
            save()

    from higgs_engine.dynamic import get_profile

    held = tokenize(tok, text)[HELD_OUT_FROM * args.context :]
    for source in ("random", "self", "real"):
        sim.restore()
        t0 = time.perf_counter()
        # Through the engine's cached get_profile, as `higgs quantize --avg-bits` runs it; "real"
        # gets the held-out news text (decoded back from its tokens).
        cfg = pcfg if source != "random" else replace(pcfg, data_free="random")
        real_text = None
        if source == "real":
            real_text = tok.decode(held[: pcfg.tokens * 2].tolist())
        prof = get_profile(SMOLLM_DIR, cfg, text=real_text, cache_dir=args.profile_cache)
        wall = time.perf_counter() - t0
        res["profiles"][source] = {
            "calibration": prof.calibration,
            "tokens": pcfg.tokens,
            "seconds_this_run": wall,
            "profile_cost": prof.cost,
            "base_ppl_on_its_tokens": prof.base.get("ppl"),
            "alphas": prof.alphas(),
        }
        if source == "self":
            from higgs_engine.selfgen import SelfGenConfig, cached_self_tokens

            if args.profile_cache is not None:
                sg = SelfGenConfig(count=pcfg.windows, length=pcfg.context, seed=pcfg.seed)
                from higgs_engine.dynamic import source_fingerprint

                toks = cached_self_tokens(
                    model, tok, source_fingerprint(SMOLLM_DIR), args.profile_cache, sg
                )
                res["profiles"][source]["sample"] = tok.decode(toks[0, :80].tolist())
        log(
            f"profile {source}: {wall:.0f}s this run, cost {prof.cost}, base ppl on its tokens {prof.base.get('ppl')}"
        )
        run_budgets(source, prof)
    sim.restore()
    save()
    print(to_markdown(res))
    return 0


def to_markdown(res: dict[str, Any]) -> str:
    e = res["eval"]
    lines = [
        "### Data-free profile sources on SmolLM2-135M",
        "",
        f"Fisher profiles ({res['profile_config']['windows']} x {res['profile_config']['context']} tokens, "
        f"{res['profile_config']['fisher_samples']} label draws per window) on random tokens, self-generated "
        f"text and held-out news text; dynamic HIGGS at each budget, evaluated on the first {e['windows']} "
        f"news windows of {e['context']} tokens (base perplexity {fmt(res['base']['ppl'])}). HIGGS settings: "
        f"sign_seed {res['higgs_config']['sign_seed']}, scale rule {res['higgs_config']['scale_rule']}, "
        f"block {res['higgs_config']['rotation_block']}.",
        "",
    ]
    cols = [
        ("source", "profile tokens"),
        ("target_bits", "target bits"),
        ("bits", "bits/weight"),
        ("kl", "KL"),
        ("ppl", "perplexity"),
        ("predicted_kl", "predicted KL"),
        ("predicted_over_measured", "predicted / measured"),
    ]
    lines += [markdown_table(res["runs"], cols), ""]
    prow = [
        {
            "source": s,
            "calibration": p["calibration"],
            "tokens": p["tokens"],
            "secs": p["profile_cost"].get("seconds"),
            "this_run": p["seconds_this_run"],
            "ppl": p["base_ppl_on_its_tokens"],
        }
        for s, p in res["profiles"].items()
    ]
    lines += [
        markdown_table(
            prow,
            [
                ("source", "profile tokens"),
                ("calibration", "calibration id"),
                ("tokens", "tokens"),
                ("secs", "profile s (when measured)"),
                ("this_run", "s in this run (0 = cached)"),
                ("ppl", "base ppl on these tokens"),
            ],
        ),
        "",
    ]
    if "self" in res["profiles"] and "sample" in res["profiles"]["self"]:
        sample = res["profiles"]["self"]["sample"].replace("\n", " ").replace("|", "/")
        lines += [f"Start of a self-generated window: `{sample[:200]}`", ""]
    env = res["environment"]["start"]
    lines.append(
        f"Measured {env['date']}, torch {env['torch']}, {env['torch_threads']} thread(s), load average at start "
        f"{env['load_average_1_5_15']}; {res.get('wall_seconds', 0):.0f} s (shared machine: seconds are noisy)."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
