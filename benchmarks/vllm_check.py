"""vLLM serves what `--format compressed-tensors` writes: SmolLM2-135M (or a checkpoint given)
quantized with `--bits 4`, loaded by vLLM, and vLLM's log-probabilities of a few prompts'
tokens compared with transformers' (which loads the same directory through compressed-tensors),
both on CUDA.

Needs CUDA and the `vllm` package (scripts/gpu_check runs it on a machine that has them);
anywhere else it prints one skip line and exits 0.

    python -m benchmarks.vllm_check [--source DIR] [--out-dir DIR]
    -> DIR/vllm_check.json and vllm_check.md (default DIR: benchmarks/results)
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import environment, write_results

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PROMPTS = (
    "The capital of France is",
    "In 1969, the first people to walk on the Moon were",
    "A good way to learn a new programming language is to",
    "def fibonacci(n):",
)
# vLLM's Marlin kernels and transformers' dequantized matmul differ in float16 rounding: the
# mean absolute log-probability difference must stay small, not zero.
MEAN_ABS_LIMIT = 0.05


def skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "the vllm package is not installed"
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None


def transformers_logprobs(path: Path, token_ids: list[list[int]]) -> list[list[float]]:
    """log p(token t | tokens < t) of every prompt token after the first, from transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float16)
    model = model.to("cuda").eval()
    out = []
    with torch.no_grad():
        for ids in token_ids:
            x = torch.tensor([ids], device="cuda")
            lp = torch.log_softmax(model(x).logits.float()[0], dim=-1)
            out.append([float(lp[i - 1, ids[i]]) for i in range(1, len(ids))])
    del model
    torch.cuda.empty_cache()
    return out


def vllm_logprobs(path: Path, token_ids: list[list[int]]) -> list[list[float]]:
    """The same log-probabilities from vLLM's prompt_logprobs."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(path), dtype="float16", gpu_memory_utilization=0.3, enforce_eager=True)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in token_ids], params)
    result = []
    for ids, o in zip(token_ids, outs, strict=True):
        per = o.prompt_logprobs or []
        result.append([float(per[i][ids[i]].logprob) for i in range(1, len(ids))])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=ROOT / "data" / "smollm2-135m")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    why = skip_reason()
    if why is not None:
        print(f"vllm_check: skipped: {why}")
        return 0
    from transformers import AutoTokenizer

    from higgs_engine.job import CtOptions, QuantizeJob, run

    with tempfile.TemporaryDirectory(prefix="vllm-check-") as tmp:
        rep = run(QuantizeJob(args.source, ct=CtOptions(bits=4)), Path(tmp) / "out")
        ct = Path(tmp) / "out" / "compressed-tensors"
        tok = AutoTokenizer.from_pretrained(str(ct))
        ids = [tok(p)["input_ids"] for p in PROMPTS]
        theirs = vllm_logprobs(ct, ids)
        ours = transformers_logprobs(ct, ids)
    diffs = [
        abs(a - b) for xs, ys in zip(ours, theirs, strict=True) for a, b in zip(xs, ys, strict=True)
    ]
    mean_abs = math.fsum(diffs) / len(diffs)
    payload: dict[str, Any] = {
        "environment": environment(),
        "source": str(args.source),
        "bits_per_weight": rep.bits_per_weight,
        "tokens": len(diffs),
        "mean_abs_logprob_diff": mean_abs,
        "max_abs_logprob_diff": max(diffs),
        "limit": MEAN_ABS_LIMIT,
        "met": mean_abs <= MEAN_ABS_LIMIT,
    }
    md = (
        "## vLLM against transformers on our compressed-tensors checkpoint\n\n"
        f"{args.source.name} `--bits 4` ({rep.bits_per_weight:.3f} bits/weight): over "
        f"{len(diffs)} prompt tokens of {len(PROMPTS)} prompts, |log p vLLM - log p "
        f"transformers| mean {mean_abs:.4f}, max {max(diffs):.4f} (limit on the mean "
        f"{MEAN_ABS_LIMIT}: {'met' if payload['met'] else 'missed'}).\n"
    )
    write_results("vllm_check", payload, md, args.out_dir)
    print(md)
    return 0 if payload["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
