"""What running each output costs: generation speed of SmolLM2-135M and encoding speed of
all-MiniLM-L6-v2, the 16-bit model against its `--bits 4` outputs as their users run them, side
by side in one run on the same threads.

- base: the source checkpoint in transformers (float32 on the CPU);
- native: the exact HIGGS format through the project's loader (HiggsLinear builds each layer's
  rotated weight from the codes at every call and rotates the activations);
- compressed-tensors: the directory loaded by transformers through compressed-tensors (on the
  CPU it decompresses the weights once, at load, and runs dense float32);
- gguf (SmolLM2 only): the `--bits 4` file (Q4_K where it fits) in llama.cpp (llama-cpp-python).

SmolLM2: a prompt of P tokens of news text, then N tokens greedily, with the KV cache; prefill
milliseconds and decode tokens per second, where decode = (N - 1) tokens over (time of N tokens
minus time of 1). MiniLM: sentences per second of one forward over a batch of B news sentences.
Each figure is the median of R repeats, the formats interleaved so machine load hits all alike.

    python -m benchmarks.decode_speed [--repeats R] [--new-tokens N] [--prompt-tokens P]
        [--batch B] [--threads T] [--models smollm2,minilm]

Writes benchmarks/results/decode_speed.json and .md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import environment, markdown_table, write_results

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"smollm2": ROOT / "data" / "smollm2-135m", "minilm": ROOT / "data" / "minilm"}
FORMATS = {
    "smollm2": ("native", "compressed-tensors", "gguf"),
    "minilm": ("native", "compressed-tensors"),
}


def quantize(src: Path, fmt: str, out: Path) -> dict[str, Any]:
    """`higgs quantize SRC --format FMT --bits 4` in a fresh process; its report."""
    higgs = Path(sys.executable).with_name("higgs")
    cmd = [str(higgs), "quantize", str(src), "--out", str(out), "--format", fmt, "--bits", "4"]
    proc = subprocess.run([*cmd, "--quiet"], capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def weight_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


ENGINES = {
    "base": "transformers",
    "native": "higgs loader",
    "compressed-tensors": "transformers",
    "gguf": "llama.cpp",
}


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens two greedy generations share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """Seconds one call takes, and what it returned."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


class TorchDecoder:
    """Greedy generation with transformers' `generate` (KV cache on)."""

    def __init__(self, model: Any, prompt: list[int]) -> None:
        import torch

        self.model = model
        self.ids = torch.tensor([prompt])

    def generate(self, n: int) -> list[int]:
        import torch

        with torch.inference_mode():
            out = self.model.generate(
                self.ids,
                attention_mask=torch.ones_like(self.ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return [int(t) for t in out[0, self.ids.shape[1] :]]


class LlamaDecoder:
    """Greedy generation in llama.cpp: the prompt in one batch, then one token at a time."""

    def __init__(self, path: Path, prompt: list[int], threads: int, context: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        self.prompt = prompt

    def generate(self, n: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(self.prompt)
        out: list[int] = []
        for _ in range(n):
            tok = int(self.llm.sample(temp=0.0))
            out.append(tok)
            self.llm.eval([tok])
        return out


def _decoders(
    model: str, dirs: dict[str, Path], prompt: list[int], threads: int, context: int
) -> dict[str, Callable[[], Any]]:
    """A loader per format, each returning an object with generate(n)."""
    import torch

    from devtools.quality import load_causal_lm
    from higgs_engine.artifacts import load_model

    def base() -> Any:
        return TorchDecoder(load_causal_lm(MODELS[model])[0], prompt)

    def native() -> Any:
        return TorchDecoder(load_model(dirs["native"] / "native", dtype=torch.float32)[0], prompt)

    def ct() -> Any:
        return TorchDecoder(
            load_causal_lm(dirs["compressed-tensors"] / "compressed-tensors")[0], prompt
        )

    def gguf() -> Any:
        (f,) = sorted((dirs["gguf"] / "gguf").glob("*.gguf"))
        return LlamaDecoder(f, prompt, threads, context)

    return {"base": base, "native": native, "compressed-tensors": ct, "gguf": gguf}


def run_smollm2(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from devtools.quality import NEWS_FILE

    src = MODELS["smollm2"]
    tok = AutoTokenizer.from_pretrained(str(src))
    text = NEWS_FILE.read_text(encoding="utf-8")
    prompt = tok(text, add_special_tokens=False)["input_ids"][: args.prompt_tokens]
    dirs: dict[str, Path] = {}
    reports: dict[str, dict[str, Any]] = {}
    for fmt in FORMATS["smollm2"]:
        dirs[fmt] = work / f"smollm2-{fmt}"
        reports[fmt] = quantize(src, fmt, dirs[fmt])
    loaders = _decoders(
        "smollm2", dirs, prompt, args.threads, args.prompt_tokens + args.new_tokens + 8
    )
    names = ["base", *FORMATS["smollm2"]]
    first: dict[str, list[float]] = {n: [] for n in names}
    full: dict[str, list[float]] = {n: [] for n in names}
    texts: dict[str, list[int]] = {}
    for r in range(args.repeats):
        order = names if r % 2 == 0 else list(reversed(names))
        for name in order:
            dec = loaders[name]()
            dec.generate(2)  # warm-up: first-call allocations and kernel choices
            first[name].append(_timed(dec.generate, 1)[0])
            seconds, out = _timed(dec.generate, args.new_tokens)
            full[name].append(seconds)
            texts[name] = out
            del dec
            gc.collect()
    rows: list[dict[str, Any]] = []
    for name in names:
        t1, tn = statistics.median(first[name]), statistics.median(full[name])
        decode = (args.new_tokens - 1) / max(tn - t1, 1e-9)
        path = (
            src
            if name == "base"
            else (
                next((dirs[name] / "gguf").glob("*.gguf")) if name == "gguf" else dirs[name] / name
            )
        )
        rows.append(
            {
                "model": "smollm2",
                "format": name,
                "engine": ENGINES[name],
                "bits_per_weight": None if name == "base" else reports[name]["bits_per_weight"],
                "weights_bytes": weight_bytes(path),
                "prefill_ms": 1000 * t1,
                "decode_tok_s": decode,
                "first_s": first[name],
                "full_s": full[name],
                "same_prefix_as_base": _common_prefix(texts[name], texts["base"]),
            }
        )
    base_rate = rows[0]["decode_tok_s"]
    for row in rows:
        row["decode_vs_base"] = row["decode_tok_s"] / base_rate
    return {"model": "smollm2", "rows": rows}


def run_minilm(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    from devtools.quality import NEWS_FILE, load_encoder, news_sentences
    from higgs_engine.artifacts import load_model

    src = MODELS["minilm"]
    dirs: dict[str, Path] = {}
    reports: dict[str, dict[str, Any]] = {}
    for fmt in FORMATS["minilm"]:
        dirs[fmt] = work / f"minilm-{fmt}"
        reports[fmt] = quantize(src, fmt, dirs[fmt])
    _, tok = load_encoder(src)
    sentences = news_sentences(NEWS_FILE.read_text(encoding="utf-8"), args.batch)
    batch = tok(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt")
    loaders: dict[str, Callable[[], Any]] = {
        "base": lambda: load_encoder(src)[0],
        "native": lambda: load_model(dirs["native"] / "native", dtype=torch.float32)[0],
        "compressed-tensors": lambda: load_encoder(
            dirs["compressed-tensors"] / "compressed-tensors"
        )[0],
    }
    names = ["base", *FORMATS["minilm"]]
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.repeats):
        order = names if r % 2 == 0 else list(reversed(names))
        for name in order:
            m = loaders[name]()
            with torch.inference_mode():
                m(**batch)  # warm-up
                times[name].append(_timed(m, **batch)[0])
            del m
            gc.collect()
    rows: list[dict[str, Any]] = []
    for name in names:
        t = statistics.median(times[name])
        path = src if name == "base" else dirs[name] / name
        rows.append(
            {
                "model": "minilm",
                "format": name,
                "engine": ENGINES[name],
                "bits_per_weight": None if name == "base" else reports[name]["bits_per_weight"],
                "weights_bytes": weight_bytes(path),
                "encode_sent_s": len(sentences) / t,
                "batch_s": times[name],
            }
        )
    base_rate = rows[0]["encode_sent_s"]
    for row in rows:
        row["encode_vs_base"] = row["encode_sent_s"] / base_rate
    return {"model": "minilm", "rows": rows, "sentences": len(sentences)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="smollm2,minilm")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    env_before = environment()
    results = []
    with tempfile.TemporaryDirectory(prefix="decode-bench-") as tmp:
        for model in args.models.split(","):
            run = run_smollm2 if model == "smollm2" else run_minilm
            results.append(run(args, Path(tmp)))
    env_after = environment()
    payload = {
        "environment": env_before,
        "load_average_after": env_after["load_average_1_5_15"],
        "repeats": args.repeats,
        "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "batch": args.batch,
        "threads": args.threads,
        "results": results,
    }
    lines = ["## Running the outputs: generation and encoding speed, `--bits 4`", ""]
    for r in results:
        if r["model"] == "smollm2":
            cols = [
                ("format", "SmolLM2 output"),
                ("engine", "run by"),
                ("bits_per_weight", "bits/weight"),
                ("weights_bytes", "weight bytes"),
                ("prefill_ms", f"prefill {args.prompt_tokens} tokens, ms"),
                ("decode_tok_s", "decode tokens/s"),
                ("decode_vs_base", "decode vs base"),
                ("same_prefix_as_base", f"first of {args.new_tokens} tokens equal to base's"),
            ]
        else:
            cols = [
                ("format", "MiniLM output"),
                ("engine", "run by"),
                ("bits_per_weight", "bits/weight"),
                ("weights_bytes", "weight bytes"),
                ("encode_sent_s", f"sentences/s (batch {r['sentences']})"),
                ("encode_vs_base", "vs base"),
            ]
        lines += [markdown_table(r["rows"], cols), ""]
    lines.append(
        f"Medians of {args.repeats} interleaved repeats, {args.threads} threads for torch and "
        f"llama.cpp alike; base = the source checkpoint in transformers, float32. SmolLM2: a "
        f"prompt of {args.prompt_tokens} news tokens, then {args.new_tokens} greedy tokens with "
        f"the KV cache. Load average {env_before['load_average_1_5_15']} before, "
        f"{env_after['load_average_1_5_15']} after; {env_before['date']}."
    )
    write_results("decode_speed", payload, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
