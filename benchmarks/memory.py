"""Memory benchmark: peak RSS of `higgs quantize` as the checkpoint grows.

Synthetic checkpoints that differ only in their number of layers (TinyLlama-1.1B's real Llama
config: hidden 2048, intermediate 5632, 32 heads, 4 KV heads, vocab 32000, tied embeddings;
random float32 weights by default (float16 with --dtype), one safetensors shard per layer plus
an index) of about 0.5, 1 and 2 GB (1, 4 and 10 layers in float32) are written to a temporary folder tensor by tensor (no model is built in memory). Each is
quantized by the `higgs quantize` CLI in a child process (HIGGS p=2 n=256, both formats) whose
peak RSS is read from os.wait4's rusage for that child alone.

Target: the peak grows by less than 25% from 0.5 to 2 GB, because the engine streams tensors
instead of loading the model.

Writes benchmarks/results/memory.json and memory.md.

Usage: python -m benchmarks.memory [--layers 4 10 21] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, environment, markdown_table, write_results

CONFIG: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


def layer_shapes(cfg: dict[str, Any], i: int) -> dict[str, tuple[int, ...]]:
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    pre = f"model.layers.{i}"
    return {
        f"{pre}.self_attn.q_proj.weight": (h, h),
        f"{pre}.self_attn.k_proj.weight": (kv, h),
        f"{pre}.self_attn.v_proj.weight": (kv, h),
        f"{pre}.self_attn.o_proj.weight": (h, h),
        f"{pre}.mlp.gate_proj.weight": (f, h),
        f"{pre}.mlp.up_proj.weight": (f, h),
        f"{pre}.mlp.down_proj.weight": (h, f),
        f"{pre}.input_layernorm.weight": (h,),
        f"{pre}.post_attention_layernorm.weight": (h,),
    }


class _RandomPool:
    """Random N(0, 0.02^2) float16 values, drawn once and sliced at random offsets.

    Drawing ~1e9 Gaussian numbers takes minutes on a small machine; quantization memory does
    not depend on the values, only on them being ordinary weights (distinct per tensor).
    """

    def __init__(self, size: int, seed: int, dtype: torch.dtype) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.pool = (torch.randn(size, generator=self.gen) * 0.02).to(dtype)

    def tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:
            return torch.ones(shape, dtype=self.dtype)
        numel = int(torch.Size(shape).numel())
        start = int(torch.randint(0, self.pool.numel(), (1,), generator=self.gen).item())
        rolled = self.pool.roll(-start)
        reps = -(-numel // rolled.numel())
        return rolled.repeat(reps)[:numel].reshape(shape).clone()


def write_checkpoint(path: Path, layers: int, seed: int = 0, dtype: str = "float32") -> int:
    """A sharded Llama checkpoint with `layers` decoder layers; returns its bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path.mkdir(parents=True)
    LlamaConfig(num_hidden_layers=layers, dtype=dtype, **CONFIG).save_pretrained(path)
    pool = _RandomPool(1 << 24, seed, getattr(torch, dtype))
    shards: list[dict[str, tuple[int, ...]]] = [
        {
            "model.embed_tokens.weight": (CONFIG["vocab_size"], CONFIG["hidden_size"]),
            "model.norm.weight": (CONFIG["hidden_size"],),
        }
    ]
    shards += [layer_shapes(CONFIG, i) for i in range(layers)]
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {key: pool.tensor(shape) for key, shape in shard.items()}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return total


def higgs_command() -> list[str]:
    exe = Path(sys.executable).parent / "higgs"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("higgs")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from higgs_cli.main import main; sys.exit(main())"]


def run_measured(cmd: list[str]) -> tuple[int, float, int, str]:
    """Run `cmd`; return (exit code, wall seconds, peak RSS bytes of that child, stderr tail)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        err.seek(0)
        tail = err.read().decode(errors="replace")[-2000:]
    # Linux reports ru_maxrss in KiB
    return proc.returncode, wall, int(usage.ru_maxrss) * 1024, tail


def to_markdown(p: dict[str, Any]) -> str:
    rows = [
        dict(r, checkpoint_gb=r["checkpoint_bytes"] / 1e9, peak_rss_gb=r["peak_rss_bytes"] / 1e9)
        for r in p["rows"]
    ]
    cols = [
        ("layers", "layers"),
        ("checkpoint_gb", "checkpoint GB"),
        ("quantized_weights", "quantized weights"),
        ("peak_rss_gb", "peak RSS GB"),
        ("wall_seconds", "wall s"),
        ("exit_code", "exit"),
    ]
    g = p.get("growth")
    lines = [
        f"### Memory: peak RSS of `{p['command']}` on synthetic Llama checkpoints ({p['dtype']} weights)",
        "",
        markdown_table(rows, cols),
        "",
    ]
    if g is not None:
        lines.append(
            f"Peak RSS growth from the smallest to the largest checkpoint "
            f"({rows[0]['checkpoint_gb']:.2f} -> {rows[-1]['checkpoint_gb']:.2f} GB): "
            f"**{g * 100:.1f}%** (target < 25%: {'met' if g < 0.25 else 'NOT met'})."
        )
    env = p["environment"]
    lines.append(
        f"\nMeasured {env['date']}, {env['cpu_count']} CPUs, load average {env['load_average_1_5_15']}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="peak RSS of higgs quantize vs checkpoint size")
    ap.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=[1, 4, 10],
        help="decoder layers per checkpoint (float32: 1/4/10 give about 0.45/0.97/2.0 GB; "
        "float16: 4/10/21 give about 0.5/1/2 GB)",
    )
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    ap.add_argument("--tmp", type=Path, default=None, help="where to write the checkpoints")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    cli = higgs_command()
    env = environment()
    rows = []
    with tempfile.TemporaryDirectory(prefix="higgs-memory-", dir=args.tmp) as tmp:
        for layers in args.layers:
            src = Path(tmp) / f"llama-{layers}l"
            out = Path(tmp) / f"out-{layers}l"
            size = write_checkpoint(src, layers, dtype=args.dtype)
            per_layer = sum(
                int(torch.Size(s).numel())
                for k, s in layer_shapes(CONFIG, 0).items()
                if len(s) == 2
            )
            cmd = [
                *cli,
                "quantize",
                str(src),
                "--out",
                str(out),
                "--p",
                "2",
                "--n",
                "256",
                "--quiet",
            ]
            code, wall, rss, err = run_measured(cmd)
            print(
                f"[memory] {layers} layers, {size / 1e9:.2f} GB: exit {code}, {wall:.1f}s, "
                f"peak RSS {rss / 1e9:.3f} GB",
                flush=True,
            )
            if code != 0:
                print(err, file=sys.stderr)
            rows.append(
                {
                    "layers": layers,
                    "checkpoint_bytes": size,
                    "quantized_weights": per_layer * layers,
                    "peak_rss_bytes": rss,
                    "wall_seconds": wall,
                    "exit_code": code,
                    "stderr_tail": err if code else "",
                }
            )
            shutil.rmtree(src, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
    ok = [r for r in rows if r["exit_code"] == 0]
    growth = ok[-1]["peak_rss_bytes"] / ok[0]["peak_rss_bytes"] - 1 if len(ok) >= 2 else None
    payload = {
        "benchmark": "memory",
        "command": " ".join(["higgs", "quantize", "SRC", "--out", "DIR", "--p", "2", "--n", "256"]),
        "config": CONFIG,
        "dtype": args.dtype,
        "rows": rows,
        "growth": growth,
        "environment": env,
        "method": "peak RSS of the CLI child process from os.wait4 rusage (ru_maxrss)",
    }
    md = to_markdown(payload)
    j, m = write_results("memory", payload, md, args.out_dir)
    print(md)
    print(f"wrote {j}, {m}")
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
