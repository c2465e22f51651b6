"""GPU quantization check and timing: the same checkpoints quantized on the CPU and on CUDA.

Run on a machine with CUDA (scripts/gpu_check does, with the gpu-marked tests first). Builds
synthetic Llama checkpoints from real configs with random weights (no download), then for each:
`quantize_checkpoint(device="cpu")` and `(device="cuda")` in the same process, their stage
timings, and how far the two agree (per-layer relative error; the codes may differ only at
float32 near-ties). Also the matrix-level rate of `quantize_matrix` on both devices.

    python benchmarks/gpu_speed.py [--out-dir DIR] [--sizes smollm2-135m llama-1b]
    -> DIR/gpu_speed.json and gpu_speed.md (default DIR: benchmarks/results)

Without CUDA it runs the CPU half only and says so (a dry run of the script).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from higgs_engine.pipeline import quantize_checkpoint  # noqa: E402
from higgs_engine.planning.config import HiggsConfig  # noqa: E402
from higgs_engine.quantize import quantize_matrix  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# Real shapes: SmolLM2-135M's config, and a 1B-class Llama (TinyLlama-like widths).
SIZES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=False,
    ),
}


def build_checkpoint(kind: str, dest: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SIZES[kind], max_position_embeddings=2048)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).bfloat16()
    model.save_pretrained(dest, safe_serialization=True)
    return dest


def run_pipeline(src: Path, out: Path, device: str) -> dict[str, Any]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rep = quantize_checkpoint(src, out, HiggsConfig.from_bits(4), device=device)
    wall = time.perf_counter() - t0
    return {
        "device": device,
        "wall_s": wall,
        "timings": rep.timings,
        "bits_per_weight": rep.bits_per_weight,
        "params_quantized": rep.params_quantized,
        "rel_errors": {r.name: r.rel_error for r in rep.layers if r.p},
    }


def matrix_rate(
    device: str, rows: int = 8192, cols: int = 2048, repeats: int = 3
) -> dict[str, Any]:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    w = w.to(device)
    quantize_matrix(w, 2, 256, device=device)  # warm-up (grid tables / kernels)
    best = float("inf")
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        quantize_matrix(w, 2, 256, device=device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return {
        "device": device,
        "shape": [rows, cols],
        "seconds": best,
        "weights_per_s": rows * cols / best,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument(
        "--sizes", nargs="+", default=["smollm2-135m", "llama-1b"], choices=sorted(SIZES)
    )
    args = ap.parse_args()
    has_cuda = torch.cuda.is_available()
    devices = ["cpu", "cuda"] if has_cuda else ["cpu"]
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if has_cuda else None,
        "cpu_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    result: dict[str, Any] = {"environment": env, "models": [], "matrix": []}
    for dev in devices:
        result["matrix"].append(matrix_rate(dev))
        print("[gpu_speed] matrix", result["matrix"][-1], flush=True)
    with tempfile.TemporaryDirectory(prefix="higgs-gpu-") as tmp:
        for kind in args.sizes:
            src = build_checkpoint(kind, Path(tmp) / kind)
            runs = [run_pipeline(src, Path(tmp) / f"{kind}-{dev}", dev) for dev in devices]
            entry: dict[str, Any] = {"model": kind, "runs": runs}
            if len(runs) == 2:
                a, b = runs[0]["rel_errors"], runs[1]["rel_errors"]
                entry["max_rel_error_difference"] = max(abs(a[k] - b[k]) / a[k] for k in a)
                entry["speedup"] = runs[0]["wall_s"] / runs[1]["wall_s"]
            for r in runs:
                r["mean_rel_error"] = sum(r["rel_errors"].values()) / len(r["rel_errors"])
                del r["rel_errors"]
            result["models"].append(entry)
            print("[gpu_speed]", json.dumps(entry)[:400], flush=True)
    md = ["### GPU check: HIGGS p=2 n=256 quantization on the CPU and on CUDA", ""]
    if not has_cuda:
        md += ["**No CUDA device: only the CPU half ran (a dry run of this script).**", ""]
    md += [
        "| model | device | wall s | quantizing s | bits/weight | mean t² |",
        "|---|---|---|---|---|---|",
    ]
    for m in result["models"]:
        for r in m["runs"]:
            md.append(
                f"| {m['model']} | {r['device']} | {r['wall_s']:.2f} | {r['timings'].get('quantizing', 0):.2f} | "
                f"{r['bits_per_weight']:.4f} | {r['mean_rel_error']:.6f} |"
            )
    md += ["", "| device | matrix | seconds | weights/s |", "|---|---|---|---|"]
    for r in result["matrix"]:
        md.append(
            f"| {r['device']} | {r['shape'][0]}x{r['shape'][1]} | {r['seconds']:.4f} | {r['weights_per_s']:.3g} |"
        )
    for m in result["models"]:
        if "speedup" in m:
            md.append(
                f"\n- {m['model']}: CUDA {m['speedup']:.1f}x faster end to end; largest per-layer "
                f"relative difference of t² between devices {m['max_rel_error_difference']:.2e}"
            )
    md += ["", f"Measured {env['date']}, torch {env['torch']}, GPU {env['gpu']}."]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gpu_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "gpu_speed.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
