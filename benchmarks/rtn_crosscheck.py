"""Is our RTN baseline a standard one? Our rtn_quantize against hqq's own min-max RTN
(Quantizer with optimize=False, round_zero=True: fp16 scale and integer zero point per group of
128 along the input dimension), layer by layer on every nn.Linear of SmolLM2 but lm_head
(on the whole groups of each row: hqq has no short last group, so 576-wide rows use 512).

Our RTN-3 g128 gives SmolLM2 a perplexity of about 140, far better than weak RTN baselines
report; matching an independent implementation's weight errors layer by layer shows that this
is what the standard method gives, not a flaw of ours.

    python -m benchmarks.rtn_crosscheck   -> benchmarks/results/rtn_crosscheck.{json,md}
"""

from __future__ import annotations

import sys
import time

import torch

from benchmarks.common import environment, fmt, write_results
from devtools.quality import SMOLLM_DIR, hqq_quantize, linear_layers, load_causal_lm
from higgs_engine.methods import METHODS, Precision


def main() -> int:
    torch.set_num_threads(1)
    model, _ = load_causal_lm(SMOLLM_DIR)
    layers = [(n, m) for n, m in linear_layers(model) if not n.endswith("lm_head")]
    rows = []
    for bits in (3, 4):
        num_ours = num_hqq = den = 0.0
        worst = 0.0
        agree = total = 0
        t0 = time.perf_counter()
        for _name, mod in layers:
            w = mod.weight.detach().float()
            # hqq needs whole groups: compare on the columns that fill them (576 -> 512; the
            # groups are independent, so this drops the short tail group of each row only).
            w = w[:, : w.shape[1] // 128 * 128]
            ours = METHODS["rtn"].quantize(w, Precision(bits=bits, group_size=128)).w_hat
            ref, _ = hqq_quantize(w, bits, 128, optimize=False, round_zero=True)
            e_ours = float((ours - w).double().square().sum())
            e_ref = float((ref - w).double().square().sum())
            d = float(w.double().square().sum())
            num_ours, num_hqq, den = num_ours + e_ours, num_hqq + e_ref, den + d
            worst = max(worst, abs(e_ours - e_ref) / max(e_ref, 1e-30))
            # Weights that land on the same value (ties and fp16 rounding of 1/scale may move
            # a few by one step).
            agree += int(torch.isclose(ours, ref, rtol=0, atol=1e-6).sum())
            total += w.numel()
        rows.append(
            {
                "bits": bits,
                "group_size": 128,
                "layers": len(layers),
                "rel_error_ours": num_ours / den,
                "rel_error_hqq_rtn": num_hqq / den,
                "worst_layer_rel_difference": worst,
                "same_value_fraction": agree / total,
                "seconds": time.perf_counter() - t0,
            }
        )
        print(rows[-1], flush=True)
    md = [
        "### RTN cross-check: ours vs hqq's min-max RTN (SmolLM2-135M, every nn.Linear but lm_head)",
        "",
        "| bits | group | layers | t² ours | t² hqq RTN | worst layer rel. diff of t² | same value |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['bits']} | {r['group_size']} | {r['layers']} | {fmt(r['rel_error_ours'])} | "
            f"{fmt(r['rel_error_hqq_rtn'])} | {100 * r['worst_layer_rel_difference']:.2f}% | "
            f"{100 * r['same_value_fraction']:.2f}% |"
        )
    env = environment()
    md += ["", f"Measured {env['date']}, torch {env['torch']}."]
    write_results("rtn_crosscheck", {"environment": env, "rows": rows}, "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
