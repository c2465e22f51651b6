"""The residual-stream rotation for compressed-tensors, measured before it becomes an option:
SmolLM2-135M's compressed-tensors checkpoints with and without it, in one run, on the CPU.

The rotation is the one of the GGUF path (higgs_engine.gguf.rotate: RMSNorm weights folded into
the linears, the residual stream rotated by a seeded orthogonal matrix, V/O rotated per head):
the rotated checkpoint is an ordinary llama checkpoint that vLLM and transformers run with no
runtime support, so `higgs quantize --format compressed-tensors` takes it as it is. A tied head
is untied by the folding (the head carries the final norm's weight, the embedding does not),
and vLLM keeps the head 16-bit, so the rotated file carries one more vocab x hidden matrix.

Rows, each `higgs quantize --format compressed-tensors --dtype float16` on the checkpoint named:
    plain --bits 4 / rotated --bits 4          int4 W4A16 everywhere (group 64 on SmolLM2)
    plain --avg-bits B / rotated --avg-bits B  the allocator at the same bits per linear weight
Each directory loaded by transformers through compressed-tensors in float32 and measured on the
same --windows windows of 512 tokens of the news text: perplexity and KL from the 16-bit model.
Sizes are the bytes of the stored tensors. At equal file size the rotated file would have to
pay for its head out of the linear layers' bits; the run reports the smallest rotated file
against the plain --bits 4 one.

MiniLM is not measured: the rotation needs a pre-norm RMSNorm decoder (llama, mistral, qwen2),
and BERT's post-norm LayerNorm blocks do not commute with it.

    python -m benchmarks.ct_rotation [--windows W] [--avg-bits B]

Writes benchmarks/results/ct_rotation.json and .md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import environment, markdown_table, write_results
from benchmarks.llmcompressor import ROOT, Evaluator, run_ours, weight_bytes

SRC = ROOT / "data" / "smollm2-135m"


def main(argv: list[str] | None = None) -> int:
    from higgs_engine.gguf.rotate import write_rotated_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--avg-bits", type=float, default=4.5)
    args = ap.parse_args(argv)
    env_before = environment()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ct-rotation-") as tmp:
        work = Path(tmp)
        rotated = work / "rotated"
        about = write_rotated_checkpoint(SRC, rotated)
        sources = {"plain": SRC, "rotated": rotated}
        dirs: dict[str, Path] = {}
        for flags in (["--bits", "4"], ["--avg-bits", f"{args.avg_bits:g}"]):
            for name, src in sources.items():
                label = f"{name} {' '.join(flags)}"
                out = work / label.replace(" ", "_")
                extra = ["--dtype", "float16", *flags]
                info = run_ours(src, extra, out, work / f"profiles-{name}")
                dirs[label] = out / "compressed-tensors"
                rows.append({"method": label, **info})
        ev = Evaluator("smollm2", args.windows, 0)
        for row in rows:
            d = dirs[row["method"]]
            row["weights_bytes"] = weight_bytes(d)
            row.update(ev(d))
    by = {r["method"]: r for r in rows}
    findings = []
    for target in ("--bits 4", f"--avg-bits {args.avg_bits:g}"):
        p, r = by[f"plain {target}"], by[f"rotated {target}"]
        findings.append(
            f"{target}: rotated KL {r['kl']:.4g} against plain {p['kl']:.4g} "
            f"({'lower' if r['kl'] < p['kl'] else 'higher'}), "
            f"{r['weights_bytes']} against {p['weights_bytes']} bytes"
        )
    smallest, plain4 = by["rotated --bits 4"], by["plain --bits 4"]
    findings.append(
        f"equal size: the smallest rotated file ({smallest['weights_bytes']} bytes, --bits 4) is "
        f"{smallest['weights_bytes'] / plain4['weights_bytes']:.2f}x the plain --bits 4 file"
    )
    payload = {"environment": env_before, "model": "smollm2", "windows": args.windows,
               "rotation": {k: v for k, v in vars(about).items() if k != "path"},
               "base": ev.base, "rows": rows, "findings": findings}  # fmt: skip
    cols = [
        ("method", "checkpoint and target"),
        ("weights_bytes", "weight bytes"),
        ("bits_per_weight", "bits/linear weight"),
        ("ppl", "perplexity"),
        ("kl", "KL from base"),
        ("predicted", "predicted"),
        ("wall_s", "quantize s"),
    ]
    lines = [
        "## The residual rotation for compressed-tensors: SmolLM2-135M",
        "",
        markdown_table(rows, cols),
        "",
        *[f"- {f}" for f in findings],
        "",
        f"Base perplexity {ev.base['ppl']:.4g}; {args.windows} windows x 512 tokens of news text; "
        "every directory loaded by transformers through compressed-tensors in float32; "
        f"{env_before['date']}.",
    ]
    write_results("ct_rotation", payload, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
