"""Which tokens should a data-free profile use? Random tokens vs self-generated text vs real text.

--model smollm2 (default): one run on SmolLM2-135M, three Fisher profiles (KL metric, the engine's default profile
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

--model minilm: the same question for the all-MiniLM-L6-v2 sentence encoder, whose profiles use
the "cos" metric (mean 1 - cos of the mean-pooled final hidden state, what the quality benchmark
measures) and the engine's default encoder profile (Fisher method = Gauss-Newton estimate,
16 x 128 tokens). An encoder cannot generate text, so its data-free source "self" resolves to
random tokens framed by [CLS] ... [SEP] (docs/algorithm.md); the sources are random tokens and
held-out news text (after the evaluation sentences), each with the default Fisher (Gauss-Newton)
method and with noise injection. Each profile's
allocations at 4.13 and 3.5 bits are evaluated on the same news sentences (1 - cos, predicted
vs measured), beside uniform HIGGS p=2 n=256, NF4 b64 with double quantization and HQQ-4 g64.
Writes benchmarks/results/datafree_sources_minilm.json and .md.

    python -m benchmarks.datafree_sources [--model smollm2|minilm|all] [--eval-windows 8]
        [--sentences 2000] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, environment, fmt, markdown_table, write_results
from devtools.quality import (
    ARTIFACT_DTYPE,
    MINILM_DIR,
    NEWS_FILE,
    SMOLLM_DIR,
    CausalLMEval,
    EmbeddingEval,
    Method,
    SimulatedModel,
    hqq_fn,
    load_encoder,
    news_sentences,
    nf4_dq_fn,
    run_methods,
    smollm2_on_news,
)
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.planning.plans import Target, plan_allocation
from higgs_engine.planning.profile import DEFAULT_PROFILE, Profile

BUDGETS = (4.13, 3.5)
UNIFORM_GRIDS = ((2, 256), (2, 512))  # `--bits 4` (4.08 bits) and 4.58 bits
EVAL_SELF_SEED = 1  # the profiles' self-generated text uses seed 0
SOURCES = ("random", "self", "real", "real-b")
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
                q, w_hat = quantize_matrix_full(w, cfg.matrix_spec(g))
                assert w_hat is not None
                w_hat = w_hat.to(ARTIFACT_DTYPE)
                t2 = float((w_hat.float() - w).double().square().sum() / w.double().square().sum())
                cache[key] = (w_hat, t2, float(q.bits_per_weight()))
            w_hat, t2, bpw = cache[key]
            mod.weight.copy_(w_hat.to(mod.weight.dtype))
            t2s[name] = t2
            bits += bpw * w.numel()
    return t2s, bits / sim.weights


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", choices=["smollm2", "minilm", "all"], default="smollm2")
    ap.add_argument("--eval-windows", type=int, default=8, help="SmolLM2 evaluation windows")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--sentences", type=int, default=2000, help="MiniLM evaluation sentences")
    ap.add_argument(
        "--profile-tokens",
        type=int,
        default=None,
        help="MiniLM profiles' token budget (default: the engine's default profile's)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument(
        "--profile-cache",
        type=Path,
        default=None,
        help="the engine's profile cache (shared with quality.py)",
    )
    ap.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="only re-render the markdown of an earlier MiniLM run's JSON (measures nothing)",
    )
    args = ap.parse_args(argv)
    if args.render:
        res = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(minilm_markdown(res).rstrip() + "\n")
        return 0
    torch.set_num_threads(args.threads)
    if args.model in ("smollm2", "all"):
        run_smollm2(args)
    if args.model in ("minilm", "all"):
        run_minilm(args)
    return 0


def run_smollm2(args: argparse.Namespace) -> None:
    env = environment()
    t_run = time.perf_counter()
    model, tok, text, ev, base, sim = smollm2_on_news(args.context, args.eval_windows)
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
    from higgs_engine.selfgen import SelfGenConfig, cached_self_tokens

    log(f"base ppl {base['ppl']:.3f}")
    # A second evaluation text in the self-generated profile's own distribution: text the base
    # model generates with another seed (never a profile's tokens). Linearity is judged where
    # the alphas were measured, apart from how far that text is from news.
    from higgs_engine.planning.profile import source_fingerprint

    eval_self_cfg = SelfGenConfig(count=args.eval_windows, length=args.context, seed=EVAL_SELF_SEED)
    self_eval_tokens = cached_self_tokens(  # no cache directory: generated, not stored
        model, tok, source_fingerprint(SMOLLM_DIR), args.profile_cache, eval_self_cfg
    )
    ev_self = CausalLMEval.from_windows(self_eval_tokens)
    res["base_self_text"] = ev_self.prepare_base(model)
    res["eval_self_text"] = eval_self_cfg.to_dict()
    log(f"base ppl on self-generated evaluation text {res['base_self_text']['ppl']:.3f}")
    cache: dict[Any, Any] = {}

    uniform_measured: dict[tuple[int, int], tuple[dict[str, float], dict[str, float]]] = {}

    def run_budgets(source: str, prof: Profile) -> None:
        # uniform grids first (measured once: the allocation does not depend on the profile),
        # then the profile's dynamic allocations
        jobs: list[tuple[str, Any, float | None]] = [
            ("uniform", grid, None) for grid in UNIFORM_GRIDS
        ] + [("dynamic", None, budget) for budget in BUDGETS]
        for kind, grid, budget in jobs:
            if kind == "uniform":
                grids: dict[str, tuple[int, int] | None] = dict.fromkeys(names, grid)
                allocator_bits = None
            else:
                plan = plan_allocation(prof, hcfg, Target(avg_bits=budget), names=names)
                grids = {
                    o.name: (None if o.p == 0 else (o.p, o.n)) for o in plan.allocation.overrides()
                }
                allocator_bits = plan.allocation.avg_bits
            t2s, bits = quantize_alloc(sim, grids, hcfg, cache)
            if kind == "uniform" and grid in uniform_measured:
                m, ms = uniform_measured[grid]
            else:
                m, ms = ev.evaluate(sim.model), ev_self.evaluate(sim.model)
                if kind == "uniform":
                    uniform_measured[grid] = (m, ms)
            pred = math.fsum(max(0.0, prof.alphas()[n]) * t for n, t in t2s.items())
            ratio = pred / m["kl"] if m["kl"] else None
            ratio_self = pred / ms["kl"] if ms["kl"] else None
            res["runs"].append(
                {
                    "source": source,
                    "allocation": kind if kind == "dynamic" else f"uniform p={grid[0]} n={grid[1]}",
                    "target_bits": budget,
                    "bits": bits,
                    "allocator_bits": allocator_bits,
                    "kl": m["kl"],
                    "ppl": m["ppl"],
                    "predicted_kl": pred,
                    "predicted_over_measured": ratio,
                    "within_20pct": None if ratio is None else abs(ratio - 1.0) <= 0.2,
                    "kl_self_text": ms["kl"],
                    "predicted_over_measured_self_text": ratio_self,
                    "grids": {n: (list(g) if g else None) for n, g in grids.items()},
                }
            )
            log(
                f"{source} {kind} {grid or budget}: bits {bits:.4f} KL {m['kl']:.4f} ppl {m['ppl']:.3f} predicted {pred:.4f}"
            )
            save()

    from devtools.profiles import get_profile

    held = tokenize(tok, text)[HELD_OUT_FROM * args.context :]
    for source in SOURCES:
        sim.restore()
        t0 = time.perf_counter()
        # Through the engine's cached get_profile, as `higgs quantize --avg-bits` runs it; "real"
        # gets the held-out news text (decoded back from its tokens), "real-b" the news text
        # after that (two independent samples of the same distribution: their difference is
        # the profile's sampling noise).
        cfg = pcfg if source != "random" else replace(pcfg, data_free="random")
        real_text = None
        if source == "real":
            real_text = tok.decode(held[: pcfg.tokens * 2].tolist())
        if source == "real-b":
            real_text = tok.decode(held[pcfg.tokens * 2 : pcfg.tokens * 4].tolist())
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
        if source == "self" and args.profile_cache is not None:
            sg = SelfGenConfig(count=pcfg.windows, length=pcfg.context, seed=pcfg.seed)
            toks = cached_self_tokens(
                model, tok, source_fingerprint(SMOLLM_DIR), args.profile_cache, sg
            )
            res["profiles"][source]["sample"] = tok.decode(toks[0, :80].tolist())
        log(
            f"profile {source}: {wall:.0f}s this run, cost {prof.cost}, base ppl on its tokens {prof.base.get('ppl')}"
        )
        run_budgets(source, prof)
    sim.restore()
    res["profile_agreement"] = profile_agreement(
        {s: p["alphas"] for s, p in res["profiles"].items()}, "real"
    )
    save()
    print(to_markdown(res))


def profile_agreement(alphas: dict[str, dict[str, float]], ref: str) -> dict[str, Any]:
    """How each profile's alphas differ from the `ref` profile's: the ratio of their sums, the
    spread (standard deviation) of log(alpha / alpha_ref) over layers, and the ratio of sums per
    layer type (the last part of the layer name)."""
    out: dict[str, Any] = {}
    base = alphas[ref]
    kinds = sorted({n.rsplit(".", 1)[-1] for n in base})
    for source, a in alphas.items():
        if source == ref:
            continue
        names = [n for n in base if base[n] > 0 and a.get(n, 0.0) > 0]
        logs = [math.log(a[n] / base[n]) for n in names]
        mean = math.fsum(logs) / len(logs)
        out[source] = {
            "sum_ratio": math.fsum(a[n] for n in names) / math.fsum(base[n] for n in names),
            "log_ratio_std": math.sqrt(math.fsum((x - mean) ** 2 for x in logs) / len(logs)),
            "by_type": {
                k: math.fsum(a[n] for n in names if n.endswith("." + k))
                / math.fsum(base[n] for n in names if n.endswith("." + k))
                for k in kinds
            },
        }
    return out


def to_markdown(res: dict[str, Any]) -> str:
    e = res["eval"]
    lines = [
        "### Data-free profile sources on SmolLM2-135M",
        "",
        f"Fisher profiles ({res['profile_config']['windows']} x {res['profile_config']['context']} tokens, "
        f"{res['profile_config']['fisher_samples']} label draws per window) on random tokens, self-generated "
        f"text and held-out news text; uniform HIGGS and dynamic HIGGS at each budget, evaluated on the first {e['windows']} "
        f"news windows of {e['context']} tokens (base perplexity {fmt(res['base']['ppl'])}) and on "
        f"{e['windows']} windows of text the model generates with seed {res.get('eval_self_text', {}).get('seed')} "
        f"(base perplexity {fmt(res.get('base_self_text', {}).get('ppl'))}). HIGGS settings: "
        f"sign_seed {res['higgs_config']['sign_seed']}, scale rule {res['higgs_config']['scale_rule']}, "
        f"block {res['higgs_config']['rotation_block']}.",
        "",
    ]
    cols = [
        ("source", "profile tokens"),
        ("allocation", "allocation"),
        ("target_bits", "target bits"),
        ("bits", "bits/weight"),
        ("kl", "KL"),
        ("ppl", "perplexity"),
        ("predicted_kl", "predicted KL"),
        ("predicted_over_measured", "predicted / measured"),
        ("within_20pct", "within 20%"),
        ("kl_self_text", "KL on self text"),
        ("predicted_over_measured_self_text", "predicted / measured on self text"),
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
    agree = res.get("profile_agreement")
    if agree:
        kinds = sorted({k for v in agree.values() for k in v["by_type"]})
        arow = [
            {
                "source": s,
                "sum": v["sum_ratio"],
                "std": v["log_ratio_std"],
                **{f"t_{k}": v["by_type"][k] for k in kinds},
            }
            for s, v in agree.items()
        ]
        lines += [
            "Alphas against the real-text profile's (real-b is a second, disjoint sample of the "
            "same news text: its spread is the profile's sampling noise):",
            "",
            markdown_table(
                arow,
                [
                    ("source", "profile tokens"),
                    ("sum", "sum of alphas / real's"),
                    ("std", "std over layers of log(alpha / real's)"),
                    *[(f"t_{k}", k) for k in kinds],
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


# ---------------------------------------------------------------------------------------------
# MiniLM (an encoder: metric cos)
# ---------------------------------------------------------------------------------------------

# (label, token source, method, context): the engine's default encoder profile is "random" with
# the Fisher (Gauss-Newton) method in windows of 128 tokens (planning.profile.ENCODER_CONTEXT;
# longer windows are cut to it, so 512-token windows cannot be asked for here any more:
# results/datafree_sources_minilm_windows.md is the run that compared 512 with 128).
MINILM_PROFILES: tuple[tuple[str, str, str, int], ...] = (
    ("random", "random", "fisher", 128),
    ("real", "real", "fisher", 128),
    ("random, noise injection", "random", "noise", 128),
    ("real, noise injection", "real", "noise", 128),
)


def minilm_references() -> list[Method]:
    """The fixed competitors of the dynamic targets, on the same sentences."""
    from devtools.quality import higgs_default_fn

    return [
        Method("base", "base", {}),
        Method("HIGGS default --bits 4", "higgs", *higgs_default_fn(4.0)),
        Method("NF4 b64 dq", "nf4", {"block_size": 64, "double_quant": True}, nf4_dq_fn(64)),
        Method("HQQ-4 g64", "hqq", {"bits": 4, "group_size": 64}, hqq_fn(4)),
    ]


def run_minilm(args: argparse.Namespace) -> None:
    from devtools.profiles import get_profile
    from higgs_engine.dynamic import profile_config_for
    from higgs_engine.sources import resolve_model

    env = environment()
    t_run = time.perf_counter()
    model, tok = load_encoder(MINILM_DIR)
    text = NEWS_FILE.read_text(encoding="utf-8")
    sents = news_sentences(text, args.sentences)
    # held-out real text: everything after the last evaluation sentence
    offset = text.find(sents[-1]) + len(sents[-1])
    real_text = text[offset:]
    ev = EmbeddingEval(tok, sents)
    sim = SimulatedModel(model)
    names = [n for n, _ in sim.layers]
    hcfg = HiggsConfig()
    default_cfg = profile_config_for(resolve_model(MINILM_DIR), DEFAULT_PROFILE)
    tokens = args.profile_tokens or default_cfg.tokens
    res: dict[str, Any] = {
        "benchmark": "datafree_sources",
        "model": "minilm",
        "metric": "one_minus_cos",
        "eval": {"text": "data/news.txt", "sentences": ev.count, "pooling": "mean, L2-normalised"},
        "real_text": f"data/news.txt after character {offset} (the last evaluation sentence)",
        "default_profile_config": default_cfg.to_dict(),
        "profile_tokens": tokens,
        "higgs_config": {k: v for k, v in hcfg.to_dict().items() if k != "overrides"},
        "references": [],
        "profiles": {},
        "runs": [],
        "environment": {"start": env},
    }

    def log(msg: str) -> None:
        print(f"[minilm {time.perf_counter() - t_run:7.1f}s] {msg}", flush=True)

    def save() -> None:
        res["wall_seconds"] = time.perf_counter() - t_run
        res["environment"]["end"] = environment()
        write_results("datafree_sources_minilm", res, minilm_markdown(res), args.out_dir)

    res["references"] = run_methods(sim, ev, minilm_references(), log=log)
    save()
    cache: dict[Any, Any] = {}
    for label, source, method, context in MINILM_PROFILES:
        sim.restore()
        cfg = replace(
            DEFAULT_PROFILE,
            method=method,
            context=context,
            windows=max(1, tokens // context),
            data_free="random",
        )
        t0 = time.perf_counter()
        prof = get_profile(
            MINILM_DIR,
            cfg,
            text=real_text if source == "real" else None,
            cache_dir=args.profile_cache,
        )
        res["profiles"][label] = {
            "calibration": prof.calibration,
            "config": prof.config,
            "seconds_this_run": time.perf_counter() - t0,
            "profile_cost": prof.cost,
            "base": prof.base,
            "alphas": prof.alphas(),
        }
        log(f"profile {label}: cost {prof.cost}")
        for budget in BUDGETS:
            plan = plan_allocation(prof, hcfg, Target(avg_bits=budget), names=names)
            grids = {
                o.name: (None if o.p == 0 else (o.p, o.n)) for o in plan.allocation.overrides()
            }
            t2s, bits = quantize_alloc(sim, grids, hcfg, cache)
            m = ev.evaluate(sim.model)
            alphas = prof.alphas()
            pred = math.fsum(max(0.0, alphas[n]) * t for n, t in t2s.items())
            measured = m["one_minus_cos"]
            res["runs"].append(
                {
                    "profile": label,
                    "source": source,
                    "method": method,
                    "target_bits": budget,
                    "bits": bits,
                    "allocator_bits": plan.allocation.avg_bits,
                    "one_minus_cos": measured,
                    "predicted": pred,
                    "predicted_over_measured": pred / measured if measured else None,
                    "grids": {n: (list(g) if g else None) for n, g in grids.items()},
                }
            )
            log(f"{label} @{budget}: bits {bits:.4f} 1-cos {measured:.5f} predicted {pred:.5f}")
            save()
    sim.restore()
    save()
    print(minilm_markdown(res))


def minilm_markdown(res: dict[str, Any]) -> str:
    e = res["eval"]
    d = res["default_profile_config"]
    lines = [
        "### Data-free profile sources on all-MiniLM-L6-v2 (an encoder: metric 1 - cos)",
        "",
        f"Profiles of the metric 1 - cos (mean-pooled final hidden state) with {res['profile_tokens']} "
        f"tokens each; the engine's default for an encoder is method {d['method']} (Gauss-Newton), "
        f"{d['windows']} x {d['context']} tokens of {d['data_free']} tokens framed by [CLS] ... [SEP] "
        "(an encoder cannot generate text, so data_free 'self' resolves to random tokens). "
        f"'real' is {res['real_text']}. Each allocation is evaluated on the same {e['sentences']} "
        "news sentences (mean 1 - cos between base and quantized embeddings). HIGGS settings: "
        f"sign_seed {res['higgs_config']['sign_seed']}, scale rule {res['higgs_config']['scale_rule']}, "
        f"block {res['higgs_config']['rotation_block']}.",
        "",
        "References on the same sentences:",
        "",
        markdown_table(
            res["references"],
            [("method", "method"), ("bits", "bits/weight"), ("one_minus_cos", "1 - cos")],
        ),
        "",
        "Dynamic HIGGS from each profile ('layers': codes and scales of each layer, as the "
        "references count theirs; 'grids counted': the allocator's figure, which also counts "
        "each shared HIGGS grid table once, as the artifact stores it):",
        "",
        markdown_table(
            res["runs"],
            [
                ("profile", "profile"),
                ("target_bits", "target bits"),
                ("bits", "bits/weight (layers)"),
                ("allocator_bits", "bits/weight (grids counted)"),
                ("one_minus_cos", "1 - cos"),
                ("predicted", "predicted 1 - cos"),
                ("predicted_over_measured", "predicted / measured"),
            ],
        ),
        "",
    ]
    prow = [
        {
            "profile": k,
            "calibration": v["calibration"],
            "windows": f"{v['config']['windows']} x {v['config']['context']}",
            "secs": v["profile_cost"].get("seconds"),
            "fw": v["profile_cost"].get("forward_passes"),
            "bw": v["profile_cost"].get("backward_passes"),
        }
        for k, v in res["profiles"].items()
    ]
    lines += [
        markdown_table(
            prow,
            [
                ("profile", "profile"),
                ("calibration", "calibration id"),
                ("windows", "windows x tokens"),
                ("secs", "profile s"),
                ("fw", "forward passes"),
                ("bw", "backward passes"),
            ],
        ),
        "",
    ]
    refs = {r["method"]: r for r in res["references"]}
    # the default: the default config's measurement on random tokens (no text)
    default = next(
        (
            k
            for k, v in res["profiles"].items()
            if v["config"] == d and str(v["calibration"]).startswith("random:")
        ),
        None,
    )
    lines += [
        f"The engine's default encoder profile is the row '{default}'. "
        "Targets, dynamic HIGGS at 4.13 bits vs (lower is better):",
        "",
    ]
    for run in res["runs"]:
        if run["target_bits"] != 4.13:
            continue
        for ref in ("NF4 b64 dq", "HQQ-4 g64"):
            r = refs.get(ref)
            if r is None:
                continue
            verdict = "met" if run["one_minus_cos"] < r["one_minus_cos"] else "NOT met"
            lines.append(
                f"- profile '{run['profile']}' ({fmt(run['bits'])} bits) vs {ref} "
                f"({fmt(r['bits'])} bits): {fmt(run['one_minus_cos'])} vs "
                f"{fmt(r['one_minus_cos'])}: **{verdict}**"
            )
    env = res["environment"]["start"]
    lines += [
        "",
        f"Measured {env['date']}, torch {env['torch']}, {env['torch_threads']} thread(s), load "
        f"average at start {env['load_average_1_5_15']}; {res.get('wall_seconds', 0):.0f} s "
        "(shared machine: seconds are noisy).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
