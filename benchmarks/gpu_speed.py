"""GPU check and timing: a uniform and a dynamic run of the same checkpoints on the CPU and on
CUDA, in one process.

Run on a machine with CUDA (scripts/gpu_check does, after the gpu-marked tests). For each
checkpoint:

- uniform: `quantize_checkpoint` with the default `--bits 4` config (HIGGS p=2 n=256, random
  signs, MSE-searched unbiased scale) on each device;
- dynamic: `job.run` at `--avg-bits 4.13` with nothing cached (the data-free profile is
  measured from nothing: the model generates its text and runs the Fisher passes on the same
  device as the quantization) on each device where it is affordable (`--dynamic-cpu` lists the
  checkpoints whose dynamic run is also timed on the CPU);
- how far the CPU and CUDA results agree (per-layer relative error t^2; the codes differ only
  at float32 near-ties), and the matrix-level rate of `quantize_matrix` on both devices.

Checkpoints: SmolLM2-135M (the real one when `data/smollm2-135m` is prepared, else its config
with random weights) and a synthetic checkpoint of Llama-3-8B's shape (random bf16 weights
written shard by shard; 16 GB of disk). No download.

    python -m benchmarks.gpu_speed [--out-dir DIR] [--sizes smollm2-135m llama-8b]
        [--dynamic-cpu smollm2-135m]
    -> DIR/gpu_speed.json and gpu_speed.md (default DIR: benchmarks/results)

Without CUDA it runs the CPU half only and says so (a dry run of the script: use
`--sizes tiny`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from higgs_engine.job import QuantizeJob, run
from higgs_engine.pipeline import quantize_checkpoint
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.planning.plans import Target
from higgs_engine.quantize import quantize_matrix

RESULTS = Path(__file__).resolve().parent / "results"
REAL_SMOLLM = Path(__file__).resolve().parent.parent / "data" / "smollm2-135m"
AVG_BITS = 4.13
# Real shapes: SmolLM2-135M's config and Llama-3-8B's (random weights).
SIZES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
    "llama-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 640,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
    },
}
SHARD_BYTES = 4 * 1024**3


def build_checkpoint(kind: str, dest: Path, device: str) -> tuple[Path, str]:
    """A checkpoint of `kind`'s shape: the real SmolLM2 when prepared, else random bf16
    weights (std 0.02, norms 1) written shard by shard without building the model."""
    if kind == "smollm2-135m" and (REAL_SMOLLM / "model.safetensors").is_file():
        return REAL_SMOLLM, "real weights"
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SIZES[kind], max_position_embeddings=4096)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in LlamaForCausalLM(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    dest.mkdir(parents=True)
    gen = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    size, index, files = 0, {}, 0

    def flush() -> None:
        nonlocal shard, size, files
        files += 1
        name = f"model-{files:05d}.safetensors"
        save_file(shard, str(dest / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
            t = t.mul_(0.02).to(torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (dest / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index})
    )
    cfg.save_pretrained(dest)
    return dest, "random weights"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_uniform(src: Path, out: Path, device: str) -> dict[str, Any]:
    _sync(device)
    t0 = time.perf_counter()
    rep = quantize_checkpoint(src, out, HiggsConfig.from_bits(4), device=device)
    _sync(device)
    return {
        "run": "uniform --bits 4",
        "device": device,
        "wall_s": time.perf_counter() - t0,
        "timings": rep.timings,
        "bits_per_weight": rep.bits_per_weight,
        "rel_errors": {r.name: r.rel_error for r in rep.layers if r.p},
    }


def run_dynamic_once(src: Path, out: Path, device: str) -> dict[str, Any]:
    _sync(device)
    t0 = time.perf_counter()
    # no stores and no text cache: the profile is measured from nothing, on `device`
    rep = run(QuantizeJob(src, target=Target(avg_bits=AVG_BITS), device=device), out)
    _sync(device)
    return {
        "run": f"dynamic --avg-bits {AVG_BITS}",
        "device": device,
        "wall_s": time.perf_counter() - t0,
        "timings": rep.timings,
        "bits_per_weight": rep.bits_per_weight,
        "rel_errors": {r.name: r.rel_error for r in rep.layers if r.p},
    }


def matrix_rate(
    device: str, rows: int = 8192, cols: int = 2048, repeats: int = 3
) -> dict[str, Any]:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    w = w.to(device)
    cfg = HiggsConfig.from_bits(4)

    def once() -> None:
        quantize_matrix(w, cfg.matrix_spec(), device=device)

    once()  # warm-up (grid tables / kernels)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        once()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return {
        "device": device,
        "shape": [rows, cols],
        "seconds": best,
        "weights_per_s": rows * cols / best,
    }


def _agreement(a: dict[str, float], b: dict[str, float]) -> float:
    return max(abs(a[k] - b[k]) / a[k] for k in a if a[k] > 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument(
        "--sizes", nargs="+", default=["smollm2-135m", "llama-8b"], choices=sorted(SIZES)
    )
    ap.add_argument(
        "--dynamic-cpu",
        nargs="*",
        default=["smollm2-135m", "tiny"],
        help="checkpoints whose dynamic run is also timed on the CPU",
    )
    ap.add_argument(
        "--uniform-cpu",
        nargs="*",
        default=["smollm2-135m", "tiny"],
        help="checkpoints whose uniform run is also timed on the CPU",
    )
    args = ap.parse_args()
    has_cuda = torch.cuda.is_available()
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if has_cuda else None,
        "cpu_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    result: dict[str, Any] = {"environment": env, "models": [], "matrix": []}
    for dev in ["cpu", "cuda"] if has_cuda else ["cpu"]:
        result["matrix"].append(matrix_rate(dev))
        print("[gpu_speed] matrix", result["matrix"][-1], flush=True)
    with tempfile.TemporaryDirectory(prefix="higgs-gpu-") as tmp:
        for kind in args.sizes:
            t0 = time.perf_counter()
            src, weights = build_checkpoint(kind, Path(tmp) / kind, "cuda" if has_cuda else "cpu")
            print(f"[gpu_speed] {kind}: {weights} ({time.perf_counter() - t0:.0f} s)", flush=True)
            runs: list[dict[str, Any]] = []
            for what, fn, on_cpu in (
                ("uniform", run_uniform, kind in args.uniform_cpu),
                ("dynamic", run_dynamic_once, kind in args.dynamic_cpu),
            ):
                devices = (["cpu"] if on_cpu or not has_cuda else []) + (
                    ["cuda"] if has_cuda else []
                )
                for dev in devices:
                    r = fn(src, Path(tmp) / f"{kind}-{what}-{dev}", dev)
                    runs.append(r)
                    print(f"[gpu_speed] {kind} {what} {dev}: {r['wall_s']:.1f} s", flush=True)
            entry: dict[str, Any] = {"model": kind, "weights": weights, "runs": runs}
            by = {(r["run"].split()[0], r["device"]): r for r in runs}
            for what in ("uniform", "dynamic"):
                c, g = by.get((what, "cpu")), by.get((what, "cuda"))
                if c and g:
                    entry[f"{what}_speedup"] = c["wall_s"] / g["wall_s"]
                    entry[f"{what}_max_rel_error_difference"] = _agreement(
                        c["rel_errors"], g["rel_errors"]
                    )
            for dev in ("cpu", "cuda"):
                u, d = by.get(("uniform", dev)), by.get(("dynamic", dev))
                if u and d:
                    entry[f"dynamic_over_uniform_{dev}"] = d["wall_s"] / u["wall_s"]
            for r in runs:
                r["mean_rel_error"] = sum(r["rel_errors"].values()) / len(r["rel_errors"])
                del r["rel_errors"]
            result["models"].append(entry)
            print("[gpu_speed]", json.dumps(entry)[:600], flush=True)
            if src != REAL_SMOLLM:  # a synthetic checkpoint: free its disk for the next
                shutil.rmtree(src, ignore_errors=True)
    md = ["### GPU check: uniform and dynamic HIGGS runs on the CPU and on CUDA", ""]
    if not has_cuda:
        md += ["**No CUDA device: only the CPU half ran (a dry run of this script).**", ""]
    md += [
        "| model | weights | run | device | wall s | generating s | profiling s | "
        "quantizing s | bits/weight | mean t² |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in result["models"]:
        for r in m["runs"]:
            t = r["timings"]
            md.append(
                f"| {m['model']} | {m['weights']} | {r['run']} | {r['device']} | "
                f"{r['wall_s']:.2f} | {t.get('generating', 0):.2f} | {t.get('profiling', 0):.2f} | "
                f"{t.get('quantizing', 0):.2f} | {r['bits_per_weight']:.4f} | "
                f"{r['mean_rel_error']:.6f} |"
            )
    md += ["", "| device | matrix | seconds | weights/s |", "|---|---|---|---|"]
    for r in result["matrix"]:
        md.append(
            f"| {r['device']} | {r['shape'][0]}x{r['shape'][1]} | {r['seconds']:.4f} | "
            f"{r['weights_per_s']:.3g} |"
        )
    md.append("")
    for m in result["models"]:
        for dev in ("cpu", "cuda"):
            if f"dynamic_over_uniform_{dev}" in m:
                md.append(
                    f"- {m['model']} on {dev}: dynamic / uniform wall time "
                    f"{m[f'dynamic_over_uniform_{dev}']:.2f}x"
                )
        for what in ("uniform", "dynamic"):
            if f"{what}_speedup" in m:
                md.append(
                    f"- {m['model']} {what}: CUDA {m[f'{what}_speedup']:.1f}x faster than the CPU "
                    "end to end; largest per-layer relative difference of t² "
                    f"{m[f'{what}_max_rel_error_difference']:.2e}"
                )
    md += [
        "",
        f"Measured {env['date']}, torch {env['torch']}, GPU {env['gpu']}, "
        f"{env['cpu_threads']} CPU threads.",
    ]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gpu_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "gpu_speed.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
