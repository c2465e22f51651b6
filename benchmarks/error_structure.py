"""Where each quantizer puts its error, against where the model is sensitive (SmolLM2-135M).

The linearity prediction of the dynamic allocator, predicted = sum_l alpha_l t_l^2, prices a
layer's error by its energy alone: alpha_l is measured with isotropic noise (every entry of W_l
perturbed with the same variance). A quantizer whose error avoids the sensitive entries costs
less than that, one that concentrates it on them costs more. This script measures how much,
per quantizer, with a diagonal Kronecker (K-FAC) approximation of each layer's Fisher
information, F_ij ~ a_i b_j:

- b_j = mean over tokens of x_j^2 (the layer's input activations),
- a_i = mean over tokens and label draws of g_i^2 (the gradient of sum_t log p(y_t) with
  respect to the layer's output, labels y sampled from the model itself: the Fisher's
  expectation, as in the Fisher profile),

on held-out news windows (after the quality benchmark's 40 evaluation windows). For each
quantizer's actual error E_l = W_hat_l - W_l (W_hat rounded to float16 as in the artifact):

    structured cost  S = sum_l sum_ij a_i b_j E_ij^2
    isotropic cost   I = sum_l (sum_i a_i)(sum_j b_j) ||E_l||^2 / numel_l
    structure factor = S / I

A factor of 1: the error is priced right by its energy (isotropic noise); below 1: the error
sits where the model is less sensitive than average, so measured KL comes in under the
isotropic prediction; above 1: the reverse. Also reported per layer type, and the error's
shrinkage (-<E, W> / ||E||^2; 1 for an MSE-optimal quantizer, 0 for an error orthogonal to W).

Writes benchmarks/results/error_structure.json and .md.

    python -m benchmarks.error_structure [--windows 4] [--draws 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, environment, fmt, markdown_table, write_results
from devtools.quality import (
    ARTIFACT_DTYPE,
    NEWS_FILE,
    SMOLLM_DIR,
    SimulatedModel,
    data_ready,
    higgs_fn,
    hqq_fn,
    load_causal_lm,
    nf4_dq_fn,
    nf4_fn,
    rtn_fn,
)

HELD_OUT_FROM = 40  # the quality benchmark evaluates the first 40 windows

QuantFn = Callable[[torch.Tensor], tuple[torch.Tensor, float]]


def methods() -> list[tuple[str, QuantFn]]:
    return [
        ("HIGGS p=2 n=256 (RMS scale, no signs)", higgs_fn(2, 256)),
        ("HIGGS p=2 n=256 + unbiased scale", higgs_fn(2, 256, scale_rule="unbiased")),
        ("HIGGS p=2 n=256 + signs seed 0", higgs_fn(2, 256, sign_seed=0)),
        ("RTN-4 g128", rtn_fn(4)),
        ("NF4 b64", nf4_fn(64)),
        ("NF4 b64 dq", nf4_dq_fn(64)),
        ("HQQ-4 g64", hqq_fn(4)),
    ]


def sensitivities(
    sim: SimulatedModel, windows: torch.Tensor, draws: int, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per layer: a (out,) mean squared output gradient, b (in,) mean squared input."""
    model = sim.model
    a = {n: torch.zeros(m.out_features, dtype=torch.float64) for n, m in sim.layers}
    b = {n: torch.zeros(m.in_features, dtype=torch.float64) for n, m in sim.layers}
    hooks = []

    def grad_hook(name: str) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            a[name].add_(g.detach().reshape(-1, g.shape[-1]).double().square().sum(0))

        return hook

    for name, mod in sim.layers:

        def fwd(
            m: torch.nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor, name: str = name
        ) -> None:
            b[name].add_(inp[0].detach().reshape(-1, inp[0].shape[-1]).double().square().sum(0))
            out.register_hook(grad_hook(name))

        hooks.append(mod.register_forward_hook(fwd))
    gen = torch.Generator().manual_seed(seed)
    try:
        for w in windows:
            for _ in range(draws):
                model.zero_grad(set_to_none=True)
                logits = model(w[None]).logits[0]
                with torch.no_grad():
                    y = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen)
                logp = torch.log_softmax(logits, -1).gather(-1, y).sum()
                logp.backward()
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
    tokens = windows.numel() * draws  # every forward saw each token once per draw
    return {n: v / tokens for n, v in a.items()}, {n: v / tokens for n, v in b.items()}


def measure(
    sim: SimulatedModel, fn: QuantFn, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]
) -> dict[str, Any]:
    by_type: dict[str, list[float]] = {}
    s_tot = i_tot = e2_tot = w2_tot = dot_tot = 0.0
    bits = 0.0
    t0 = time.perf_counter()
    for name, _ in sim.layers:
        w = sim.originals[name]
        w_hat, bpw = fn(w)
        e = (w_hat.to(ARTIFACT_DTYPE).to(torch.float32) - w).double()
        e2 = e.square()
        s = float((a[name][:, None] * e2 * b[name][None, :]).sum())
        i = float(a[name].sum() * b[name].sum() * e2.sum() / e.numel())
        kind = name.rsplit(".", 1)[-1]
        acc = by_type.setdefault(kind, [0.0, 0.0])
        acc[0] += s
        acc[1] += i
        s_tot += s
        i_tot += i
        e2_tot += float(e2.sum())
        w2_tot += float(w.double().square().sum())
        dot_tot += float((e * w.double()).sum())
        bits += bpw * w.numel()
    return {
        "bits": bits / sim.weights,
        "rel_error": e2_tot / w2_tot,
        "shrink": -dot_tot / e2_tot,
        "structured": s_tot,
        "isotropic": i_tot,
        "factor": s_tot / i_tot,
        "factor_by_type": {k: v[0] / v[1] for k, v in sorted(by_type.items())},
        "seconds": time.perf_counter() - t0,
    }


def to_markdown(res: dict[str, Any]) -> str:
    types = sorted(res["rows"][0]["factor_by_type"]) if res["rows"] else []
    rows = [{**r, **{f"t:{k}": v for k, v in r["factor_by_type"].items()}} for r in res["rows"]]
    cols = [
        ("method", "quantizer"),
        ("bits", "bits/weight"),
        ("rel_error", "t²"),
        ("shrink", "shrink"),
        ("factor", "structure factor"),
    ]
    cols += [(f"t:{k}", k) for k in types]
    d = res["data"]
    env = res["environment"]["start"]
    return "\n".join(
        [
            "### Error structure against sensitivity: smollm2",
            "",
            f"Diagonal K-FAC sensitivities from {d['windows']} held-out news windows x "
            f"{d['context']} tokens (windows {d['first_window']}+), {d['draws']} label draws "
            "each. Structure factor = the error's cost under F_ij ~ a_i b_j over its cost as "
            "isotropic noise of the same energy (what the profile's alpha assumes): below 1 the "
            "error avoids the sensitive entries.",
            "",
            markdown_table(rows, cols),
            "",
            f"Measured {env['date']}, torch {env['torch']}, {env['torch_threads']} thread(s), "
            f"load average at start {env['load_average_1_5_15']}; {res['wall_seconds']:.0f} s.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="quantization error structure vs sensitivity")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ok, why = data_ready()
    if not ok:
        print(why, file=sys.stderr)
        return 2
    from higgs_engine.evaluate import text_windows, tokenize

    t0 = time.perf_counter()
    env = environment()
    model, tok = load_causal_lm(SMOLLM_DIR)
    all_windows = text_windows(
        tokenize(tok, NEWS_FILE.read_text()), args.context, HELD_OUT_FROM + args.windows
    )
    windows = all_windows[HELD_OUT_FROM:]
    if windows.shape[0] < args.windows:
        print(f"the news text has only {all_windows.shape[0]} windows", file=sys.stderr)
        return 2
    sim = SimulatedModel(model)
    a, b = sensitivities(sim, windows, args.draws)
    res: dict[str, Any] = {
        "benchmark": "error_structure",
        "model": "smollm2",
        "data": {
            "text": "data/news.txt",
            "first_window": HELD_OUT_FROM,
            "windows": int(windows.shape[0]),
            "context": args.context,
            "draws": args.draws,
        },
        "rows": [],
        "environment": {"start": env},
    }
    with torch.no_grad():
        for name, fn in methods():
            row = {"method": name, **measure(sim, fn, a, b)}
            res["rows"].append(row)
            print(
                f"{name:<40} factor={row['factor']:.3f} shrink={row['shrink']:.3f} "
                + " ".join(f"{k}={fmt(v, 3)}" for k, v in row["factor_by_type"].items()),
                flush=True,
            )
    res["wall_seconds"] = time.perf_counter() - t0
    res["environment"]["end"] = environment()
    md = to_markdown(res)
    write_results("error_structure", res, md, args.out_dir)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
