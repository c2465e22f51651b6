"""One llm-compressor recipe on one checkpoint, run by `benchmarks/llmcompressor.py` in
llm-compressor's own virtual environment (it pins an older transformers): this file imports
only llm-compressor, transformers, torch and datasets, never the project.

    <its venv>/bin/python -P benchmarks/llmcompressor_recipes.py --model DIR --recipe NAME --group G --out DIR
        [--calibration FILE --samples N --seq-len T]

Recipes (int4 symmetric weights in groups of G, activations 16-bit, the output head kept):
    w4a16       QuantizationModifier with the library's default observer
    w4a16-mse   QuantizationModifier with its MSE observer
    gptq        GPTQModifier on N windows of T tokens of the calibration text
Prints one JSON line: the recipe, the seconds the quantization took (oneshot alone; loading and
saving apart) and the observer the library recorded.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def _scheme(group: int, observer: str | None) -> dict[str, Any]:
    weights: dict[str, Any] = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": group,
    }
    if observer is not None:
        weights["observer"] = observer
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


def _dataset(tokenizer: Any, path: Path, samples: int, seq_len: int) -> Any:
    """`samples` consecutive windows of `seq_len` tokens of the text, as a datasets.Dataset."""
    from datasets import Dataset

    ids = tokenizer(path.read_text(encoding="utf-8"))["input_ids"]
    rows = [ids[i * seq_len : (i + 1) * seq_len] for i in range(samples)]
    rows = [r for r in rows if len(r) == seq_len]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * seq_len for _ in rows]})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--recipe", choices=["w4a16", "w4a16-mse", "gptq"], required=True)
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--calibration", type=Path, default=None)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()

    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(str(args.model))
    archs = [str(a) for a in (getattr(config, "architectures", None) or [])]
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    auto = AutoModelForCausalLM if causal else AutoModel
    # run in float32 (a CPU has no fast float16 kernels for the calibration passes), saved in
    # float16, the dtype our writer stores by default: scales and kept tensors alike
    model: Any = auto.from_pretrained(str(args.model), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    ignore = ["lm_head"]
    kw: dict[str, Any] = {}
    if args.recipe == "gptq":
        if args.calibration is None:
            raise SystemExit("--recipe gptq needs --calibration FILE")
        recipe: Any = GPTQModifier(config_groups=_scheme(args.group, None), ignore=ignore)
        kw = {
            "dataset": _dataset(tokenizer, args.calibration, args.samples, args.seq_len),
            "num_calibration_samples": args.samples,
            "max_seq_length": args.seq_len,
        }
    else:
        observer = "mse" if args.recipe == "w4a16-mse" else None
        recipe = QuantizationModifier(config_groups=_scheme(args.group, observer), ignore=ignore)
    t0 = time.perf_counter()
    oneshot(model=model, recipe=recipe, **kw)
    seconds = time.perf_counter() - t0
    model.to(torch.float16)
    model.config.dtype = torch.float16
    model.save_pretrained(str(args.out), save_compressed=True)
    tokenizer.save_pretrained(str(args.out))
    qc = json.loads((args.out / "config.json").read_text())["quantization_config"]
    observer_used = qc["config_groups"]["group_0"]["weights"].get("observer")
    print(json.dumps({"recipe": args.recipe, "seconds": seconds, "observer": observer_used}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
