"""Dynamic HIGGS on SmolLM2-135M, everything measured side by side in ONE run.

1. Profiles on held-out news text (the windows after the evaluation windows): noise
   injection (the paper's method) and the Fisher estimate; wall time, forward/backward passes,
   Spearman rank correlation of their alphas.
2. Allocations from each profile at the budgets of uniform HIGGS p=2 n=256 (~4.08 bits with
   every overhead), 3.5 bits, and uniform p=2 n=64 (~3.08 bits); uniform HIGGS at those grids;
   NF4 (double quant), HQQ-3/4 g64 and RTN-3/4 g128 as markers. Each one is applied to the
   model in memory (dequantized weights rounded to float16, as the dequantized artifact stores
   them) and evaluated: perplexity and KL from the base model on the first news windows.
3. Linearity: predicted change sum_l alpha_l * t_l^2 (measured t^2 of the layers actually
   quantized) versus the measured KL.
4. Allocator speed on the SmolLM2 instance (the 7B-scale figure is benchmarks/allocator_speed.py).

Writes benchmarks/results/dynamic.json, dynamic.md and dynamic_pareto.png.

    python -m benchmarks.dynamic [--eval-windows 6] [--profile-tokens 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR
from devtools.quality import (
    ARTIFACT_DTYPE,
    NEWS_FILE,
    SMOLLM_DIR,
    CausalLMEval,
    Method,
    SimulatedModel,
    hqq_fn,
    load_causal_lm,
    rtn_fn,
)
from higgs_engine.planning.allocator import (
    Allocation,
    Option,
    build_problem,
    default_options,
    solve,
)
from higgs_engine.planning.plans import layer_specs_from_profile
from higgs_engine.planning.profile import Profile, ProfileConfig, ProfileRequest
from higgs_engine.profile import ProfileRun, compute_profile


def nf4_double_quant(w: torch.Tensor) -> tuple[torch.Tensor, float]:
    """bitsandbytes-style NF4, blocks of 64, absmax double-quantized (about 4.13 bits)."""
    from higgs_engine.methods import METHODS, Precision

    res = METHODS["nf4-dq"].quantize(w, Precision(group_size=64))
    return res.w_hat, res.bits


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


class Quantized:
    """HIGGS W_hat (float16) and t^2 per (layer, grid), computed once and reused by every run."""

    def __init__(self, originals: dict[str, torch.Tensor]) -> None:
        self.originals = originals
        self.cache: dict[tuple[str, int, int], tuple[torch.Tensor, float, float]] = {}
        self.seconds = 0.0

    def get(self, name: str, p: int, n: int) -> tuple[torch.Tensor, float, float]:
        key = (name, p, n)
        if key not in self.cache:
            from higgs_engine.quantize import MatrixSpec, dequantize_matrix, quantize_matrix

            w = self.originals[name]
            t0 = time.perf_counter()
            q = quantize_matrix(w, MatrixSpec(p, n, sign_seed=None, scale_rule="rms"))
            w_hat = dequantize_matrix(q).to(ARTIFACT_DTYPE)
            self.seconds += time.perf_counter() - t0
            t2 = float(((w_hat.float() - w).double().pow(2).sum() / w.double().pow(2).sum()).item())
            self.cache[key] = (w_hat, t2, float(q.bits_per_weight()))
        return self.cache[key]


def apply_assignment(
    sim: SimulatedModel, qz: Quantized, grids: dict[str, tuple[int, int] | None]
) -> dict[str, float]:
    """Put each layer's W_hat (or its original, for None) into the model; measured t^2 per layer."""
    t2s: dict[str, float] = {}
    with torch.no_grad():
        for name, mod in sim.layers:
            g = grids[name]
            if g is None:
                mod.weight.copy_(sim.originals[name].to(ARTIFACT_DTYPE).to(mod.weight.dtype))
                t2s[name] = 0.0
                continue
            w_hat, t2, _ = qz.get(name, *g)
            mod.weight.copy_(w_hat.to(mod.weight.dtype))
            t2s[name] = t2
    return t2s


def predicted(profile: Profile, t2s: dict[str, float]) -> float:
    al = profile.alphas()
    return math.fsum(max(0.0, al[n]) * t for n, t in t2s.items())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=6)
    ap.add_argument("--profile-tokens", type=int, default=256)
    ap.add_argument("--profile-context", type=int, default=256)
    ap.add_argument("--levels", default="0.005,0.02")
    ap.add_argument("--fisher-samples", type=int, default=4)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1 is fastest on a busy 2-core box)",
    )
    ap.add_argument("--out", default=str(RESULTS_DIR / "dynamic"))
    ap.add_argument(
        "--replot", action="store_true", help="only redraw the PNG and markdown from the run's JSON"
    )
    args = ap.parse_args()
    if args.replot:
        out = Path(args.out)
        saved = json.loads(out.with_suffix(".json").read_text())
        write_md(saved, out.with_suffix(".md"))
        plot(saved, out.parent / f"{out.name}_pareto.png")
        return
    torch.set_num_threads(args.threads)
    t_run = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "settings": vars(args)
        | {"model": "SmolLM2-135M (data/smollm2-135m)", "text": "data/news.txt"},
        "machine": f"{platform.platform()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)",
    }

    def save() -> None:
        res["wall_seconds"] = time.perf_counter() - t_run
        out.with_suffix(".json").write_text(json.dumps(res, indent=2))

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_run:7.1f}s] {msg}", flush=True)

    model, tok = load_causal_lm(SMOLLM_DIR)
    text = NEWS_FILE.read_text(encoding="utf-8")
    ev = CausalLMEval(tok, text, context=args.context, windows=args.eval_windows)
    t0 = time.perf_counter()
    base = ev.prepare_base(model)
    res["base"] = base | {"seconds": time.perf_counter() - t0}
    log(f"base ppl {base['ppl']:.3f} over {base['tokens']} tokens")

    # Calibration: held-out windows after the evaluation windows.
    from higgs_engine.evaluate import text_windows, tokenize
    from higgs_engine.model_structure import quantizable_layers

    ids = tokenize(tok, text)
    held = ids[args.eval_windows * args.context :]
    pctx = min(args.profile_context, args.profile_tokens)
    calib = text_windows(held, pctx, max(1, args.profile_tokens // pctx))
    calib_id = "text:" + hashlib.sha256(calib.numpy().tobytes()).hexdigest()
    names = quantizable_layers(SMOLLM_DIR)
    sim = SimulatedModel(model)
    if [n for n, _ in sim.layers] != names:
        raise SystemExit("benchmark layers differ from the engine's quantizable layers")
    levels = tuple(float(x) for x in args.levels.split(","))
    profiles: dict[str, Profile] = {}
    for method in ("fisher", "noise"):
        cfg = ProfileConfig(
            metric="kl",
            method=method,
            levels=levels,
            context=pctx,
            windows=int(calib.shape[0]),
            fisher_samples=args.fisher_samples,
        )
        sim.restore()
        t0 = time.perf_counter()
        last = [0.0]

        def progress(
            stage: str, done: int, total: int, method: str = method, last: list[float] = last
        ) -> None:
            if time.perf_counter() - last[0] > 60:
                last[0] = time.perf_counter()
                log(f"profile {method}: {done}/{total}")

        request = ProfileRequest("smollm2-135m", None, calib_id, cfg, tuple(names))
        prof = compute_profile(model, ProfileRun(request, None, progress), calib)
        wall = time.perf_counter() - t0
        profiles[method] = prof
        prof.save(out.parent / f"dynamic_profile_{method}.json")
        al = sorted(prof.alphas().values())
        res.setdefault("profiles", {})[method] = {
            "tokens": cfg.tokens,
            "levels": list(levels) if method == "noise" else None,
            "fisher_samples": args.fisher_samples if method == "fisher" else None,
            "seconds": wall,
            "forward_passes": prof.cost["forward_passes"],
            "backward_passes": prof.cost["backward_passes"],
            "alpha_min": al[0],
            "alpha_max": al[-1],
            "alpha_spread": (al[-1] / al[0]) if al[0] > 0 else None,
            "negative_alphas": sum(1 for a in al if a < 0),
        }
        log(
            f"profile {method}: {wall:.1f} s, {prof.cost['forward_passes']:.0f} fwd / {prof.cost['backward_passes']:.0f} bwd"
        )
        save()
    sim.restore()
    na = [profiles["noise"].alphas()[n] for n in names]
    fa = [profiles["fisher"].alphas()[n] for n in names]
    ratio = sorted(f / a for f, a in zip(fa, na, strict=True) if a > 0)
    noise_lin = [
        (la.points[-1][1] / la.points[-1][0]) / (la.points[0][1] / la.points[0][0])
        for la in profiles["noise"].layers
        if la.points[0][1] > 0
    ]
    res["profile_agreement"] = {
        "spearman": spearman(na, fa),
        "median_fisher_over_noise": ratio[len(ratio) // 2],
        "cost_ratio_seconds": res["profiles"]["noise"]["seconds"]
        / res["profiles"]["fisher"]["seconds"],
        "noise_kl_per_t2_ratio_high_over_low_level_median": sorted(noise_lin)[len(noise_lin) // 2],
    }
    log(f"agreement {res['profile_agreement']}")

    # Allocations and evaluations.
    qz = Quantized(sim.originals)
    shapes = {n: tuple(sim.originals[n].shape) for n in names}
    runs: list[dict[str, Any]] = []

    def evaluate(
        label: str, family: str, bits: float, t2s: dict[str, float] | None, extra: dict[str, Any]
    ) -> dict[str, Any]:
        t0 = time.perf_counter()
        m = ev.evaluate(model)
        row = {
            "name": label,
            "family": family,
            "bits": bits,
            "kl": m["kl"],
            "ppl": m["ppl"],
            "eval_seconds": time.perf_counter() - t0,
        }
        if t2s is not None:
            row["predicted_kl_noise"] = predicted(profiles["noise"], t2s)
            row["predicted_kl_fisher"] = predicted(profiles["fisher"], t2s)
            row["mean_t2"] = (
                math.fsum(t2s[n] * shapes[n][0] * shapes[n][1] for n in names) / sim.weights
            )
        row.update(extra)
        runs.append(row)
        res["runs"] = runs
        save()
        log(
            f"{label}: bits {bits:.4f} KL {m['kl']:.4f} ppl {m['ppl']:.3f}"
            + (f" predicted {row['predicted_kl_noise']:.4f}" if t2s else "")
        )
        return row

    opts = default_options()
    uniform_bits: dict[tuple[int, int], float] = {}
    for p, n in ((2, 256), (2, 64)):
        problem = build_problem(layer_specs_from_profile(profiles["noise"], names), [Option(p, n)])
        bits = problem.total_bits([0] * len(names)) / problem.total_numel
        uniform_bits[(p, n)] = bits
        t2s = apply_assignment(sim, qz, dict.fromkeys(names, (p, n)))
        qb = (
            math.fsum(qz.get(nm, p, n)[2] * shapes[nm][0] * shapes[nm][1] for nm in names)
            / sim.weights
        )
        evaluate(
            f"HIGGS p={p} n={n} (uniform)", "higgs", bits, t2s, {"quantizer_bits_without_grid": qb}
        )

    budgets = [("4.08", uniform_bits[(2, 256)]), ("3.5", 3.5), ("3.08", uniform_bits[(2, 64)])]
    allocator_times: dict[str, float] = {}
    for method in ("noise", "fisher"):
        t0 = time.perf_counter()
        problem = build_problem(layer_specs_from_profile(profiles[method], names), opts)
        table = solve(problem, None, 1e-4)
        allocator_times[method] = time.perf_counter() - t0
        if method == "noise":
            res["pareto_predicted"] = [
                [pt.avg_bits, pt.predicted] for pt in table.pareto(0.02) if pt.avg_bits <= 8.5
            ]
        for label, b in budgets:
            if method == "fisher" and label == "3.08":
                continue
            a: Allocation = table.allocate(b)
            grids = {
                nm: (None if o.keep else (o.p, o.n))
                for nm, o in zip(a.names, a.options, strict=True)
            }
            t2s = apply_assignment(sim, qz, grids)
            evaluate(
                f"dynamic HIGGS @{label} ({method} profile)",
                f"dynamic-{method}",
                a.avg_bits,
                t2s,
                {
                    "budget": b,
                    "allocator_predicted_grid_mse": a.predicted,
                    "histogram": a.histogram(),
                },
            )
    res["allocator_seconds_smollm"] = allocator_times
    res["higgs_quantize_seconds_total"] = qz.seconds
    qz.cache.clear()

    markers = [
        Method(
            "NF4 b64 (double quant)",
            "nf4",
            {"block_size": 64, "double_quant": True},
            nf4_double_quant,
        ),
        Method("HQQ-3 g64", "hqq", {"bits": 3, "group_size": 64}, hqq_fn(3)),
        Method("HQQ-4 g64", "hqq", {"bits": 4, "group_size": 64}, hqq_fn(4)),
        Method("RTN-3 g128", "rtn", {"bits": 3, "group_size": 128}, rtn_fn(3)),
        Method("RTN-4 g128", "rtn", {"bits": 4, "group_size": 128}, rtn_fn(4)),
    ]
    for mth in markers:
        st = sim.apply(mth, keep_per_layer=True)
        t2s = {row["name"]: row["rel_error"] for row in st.per_layer}
        evaluate(mth.name, mth.family, float(st.bits or 0.0), t2s, {"quantize_seconds": st.seconds})
    sim.restore()

    summarize(res)
    save()
    write_md(res, out.with_suffix(".md"))
    plot(res, out.parent / f"{out.name}_pareto.png")
    log("done")


def _row(res: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in res["runs"] if r["name"] == name)


def summarize(res: dict[str, Any]) -> None:
    u4 = _row(res, "HIGGS p=2 n=256 (uniform)")
    u3 = _row(res, "HIGGS p=2 n=64 (uniform)")
    d4 = _row(res, "dynamic HIGGS @4.08 (noise profile)")
    d35 = _row(res, "dynamic HIGGS @3.5 (noise profile)")
    d3 = _row(res, "dynamic HIGGS @3.08 (noise profile)")
    f4 = _row(res, "dynamic HIGGS @4.08 (fisher profile)")
    f35 = _row(res, "dynamic HIGGS @3.5 (fisher profile)")
    nf4 = _row(res, "NF4 b64 (double quant)")
    hqq3 = _row(res, "HQQ-3 g64")
    lin = []
    for r in (u4, u3, d4, d35):
        lin.append(
            {
                "name": r["name"],
                "bits": r["bits"],
                "measured_kl": r["kl"],
                "predicted_kl": r["predicted_kl_noise"],
                "rel_error": r["predicted_kl_noise"] / r["kl"] - 1,
                "within_20pct": abs(r["predicted_kl_noise"] / r["kl"] - 1) <= 0.2,
            }
        )
    res["linearity"] = lin
    res["targets"] = {
        "linearity_within_20pct_at_4_bits_and_above": all(
            x["within_20pct"] for x in lin if x["bits"] >= 4
        ),
        "dynamic_4.08_beats_nf4_kl": d4["kl"] < nf4["kl"] and d4["bits"] <= nf4["bits"],
        "dynamic_4.08_beats_nf4_ppl": d4["ppl"] < nf4["ppl"],
        "uniform_4.08_beats_nf4_kl": u4["kl"] < nf4["kl"],
        "dynamic_3.5_below_half_hqq3_kl": d35["kl"] < 0.5 * hqq3["kl"],
        "dynamic_never_worse_than_uniform": d4["kl"] <= u4["kl"] and d3["kl"] <= u3["kl"],
        "fisher_cost_ratio": res["profile_agreement"]["cost_ratio_seconds"],
        "fisher_20x_cheaper": res["profile_agreement"]["cost_ratio_seconds"] >= 20,
        "fisher_kl_vs_noise_kl_4.08": f4["kl"] / d4["kl"] - 1,
        "fisher_kl_vs_noise_kl_3.5": f35["kl"] / d35["kl"] - 1,
        "fisher_allocations_within_5pct": f4["kl"] <= 1.05 * d4["kl"]
        and f35["kl"] <= 1.05 * d35["kl"],
    }


def write_md(res: dict[str, Any], path: Path) -> None:
    s = res["settings"]
    pr = res["profiles"]
    ag = res["profile_agreement"]
    pass_ratio = pr["noise"]["forward_passes"] / (
        pr["fisher"]["forward_passes"] + 2 * pr["fisher"]["backward_passes"]
    )
    lines = [
        "# Dynamic HIGGS on SmolLM2-135M",
        "",
        f"One run of `benchmarks/dynamic.py` ({res['wall_seconds'] / 60:.1f} min, {res['machine']}). "
        f"Evaluation: first {s['eval_windows']} news windows of {s['context']} tokens "
        f"({res['base']['tokens']} scored tokens), KL from the base model; base perplexity {res['base']['ppl']:.3f}. "
        f"Profiles: metric KL on {pr['noise']['tokens']} held-out news tokens (the windows after the evaluation ones). "
        "Bits per weight count codes, fp16 scales of the real block layout, grids and 16-bit layers.",
        "",
        "## Quality",
        "",
        "| method | bits/weight | KL | ppl | predicted KL (noise profile) | predicted KL (Fisher profile) |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(res["runs"], key=lambda r: r["bits"]):
        pn = f"{r['predicted_kl_noise']:.4f}" if "predicted_kl_noise" in r else ""
        pf = f"{r['predicted_kl_fisher']:.4f}" if "predicted_kl_fisher" in r else ""
        lines.append(
            f"| {r['name']} | {r['bits']:.4f} | {r['kl']:.4f} | {r['ppl']:.3f} | {pn} | {pf} |"
        )
    lines += [
        "",
        "Predicted KL = sum over layers of alpha_l x measured t_l^2 (for NF4 / HQQ / RTN too: the linearity",
        "theorem does not depend on the quantizer). The alphas were measured on a small held-out calibration",
        "sample; their common scale carries that sample's noise (the ranking, which is what the allocator",
        "uses, is stable: see the Spearman figure below), so predictions are best read relative to each other.",
        "",
        "## Linearity (predicted vs measured KL, noise profile)",
        "",
        "| run | bits | measured KL | predicted KL | relative error |",
        "|---|---|---|---|---|",
    ]
    for x in res["linearity"]:
        lines.append(
            f"| {x['name']} | {x['bits']:.4f} | {x['measured_kl']:.4f} | {x['predicted_kl']:.4f} | {100 * x['rel_error']:+.1f}% |"
        )
    lines += [
        "",
        "## Profile cost",
        "",
        "| profile | tokens | forward passes | backward passes | seconds | alpha spread |",
        "|---|---|---|---|---|---|",
    ]
    for k in ("noise", "fisher"):
        p = pr[k]
        spread = f"{p['alpha_spread']:.0f}x" if p["alpha_spread"] else "n/a"
        lines.append(
            f"| {k} | {p['tokens']} | {p['forward_passes']:.0f} | {p['backward_passes']:.0f} | {p['seconds']:.1f} | {spread} |"
        )
    lines += [
        "",
        f"Spearman rank correlation of the alphas: {ag['spearman']:.3f}; median Fisher/noise alpha ratio "
        f"{ag['median_fisher_over_noise']:.3f}; the Fisher profile took {ag['cost_ratio_seconds']:.1f}x less wall time "
        f"and {pass_ratio:.0f}x fewer forward-pass equivalents (a backward pass counted as two forwards; the "
        "noise profile's forwards rerun only the blocks from the perturbed one on, about 60% of a full pass, "
        "not discounted here). Wall times come from a 2-core machine shared with other jobs.",
        "",
        "## Targets",
        "",
    ]
    for k, v in res["targets"].items():
        lines.append(f"- {k}: {v if not isinstance(v, float) else f'{v:.4f}'}")
    lines += [
        "",
        f"Allocator on this model ({len(res['runs'])} evaluations share it): full DP table in "
        f"{res['allocator_seconds_smollm']['noise']:.2f} s (noise profile).",
        "",
        "![Pareto curve](dynamic_pareto.png)",
    ]
    path.write_text("\n".join(lines) + "\n")


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    curve = res["pareto_predicted"]
    ax.plot(
        [c[0] for c in curve],
        [max(c[1], 1e-4) for c in curve],
        "-",
        color="gray",
        label="predicted Pareto curve (noise profile)",
    )
    style = {
        "higgs": ("s", "tab:blue"),
        "dynamic-noise": ("*", "tab:red"),
        "dynamic-fisher": ("P", "tab:orange"),
        "nf4": ("^", "tab:green"),
        "hqq": ("D", "tab:purple"),
        "rtn": ("v", "tab:brown"),
    }
    seen: set[str] = set()
    for r in res["runs"]:
        mk, col = style.get(r["family"], ("o", "black"))
        lab = r["family"] if r["family"] not in seen else None
        seen.add(r["family"])
        ax.scatter(r["bits"], r["kl"], marker=mk, color=col, s=70, label=lab, zorder=3)
        if "predicted_kl_noise" in r and r["family"] in ("higgs", "dynamic-noise"):
            ax.scatter(
                r["bits"],
                r["predicted_kl_noise"],
                marker=mk,
                facecolors="none",
                edgecolors=col,
                s=70,
                zorder=3,
            )
        ax.annotate(
            r["name"].replace(" (noise profile)", "").replace(" (fisher profile)", " F"),
            (r["bits"], r["kl"]),
            fontsize=6,
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.set_yscale("log")
    ax.set_xlim(2.8, 6.2)
    ax.set_xlabel("bits per weight (everything counted)")
    ax.set_ylabel("KL from base model (filled: measured, hollow: predicted)")
    ax.set_title("SmolLM2-135M on news: dynamic HIGGS vs uniform and baselines")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
