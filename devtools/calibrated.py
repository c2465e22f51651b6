"""Calibrated methods for the quality benchmark: GPTQ int4 g128 (the data-aware baseline),
calibrated HIGGS (uniform grid) and calibrated dynamic HIGGS (profile + allocation on the
calibration text, then calibrated quantization).

Each is a `Method` with a `layer_fn`: the first call runs the whole model's calibrated pass
from the checkpoint on disk (the engine's block-by-block pass; calibrated HIGGS through the
real `quantize_checkpoint`, read back from its dequantized artifact), later calls hand out the
layers' W_hat. Seconds therefore count the whole calibrated pass.

Calibration text: the news tokens AFTER the evaluation windows (`calibration_split`), so the
calibration and evaluation tokens never overlap.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from devtools.quality import Method


@dataclass(frozen=True)
class CalibrationData:
    text: str  # the calibration text (decoded from the tokens after the evaluation windows)
    calibration: Any  # higgs_engine.calibration.Calibration
    description: str


def calibration_split(
    tokenizer: Any,
    text: str,
    skip_tokens: int,
    tokens: int,
    context: int = 512,
    where: str = "data/news.txt",
) -> CalibrationData:
    """Calibration windows from the tokens of `text` after its first `skip_tokens` (the
    evaluation windows) plus a margin of one window."""
    from higgs_engine.calibration import calibration_from_text
    from higgs_engine.evaluate import tokenize

    ids = tokenize(tokenizer, text)
    start = skip_tokens + context
    if ids.numel() - start < tokens + context:
        raise ValueError(
            f"the text has {ids.numel()} tokens: not {tokens} left after the first {start}"
        )
    cal_text = tokenizer.decode(ids[start:].tolist())
    cal = calibration_from_text(cal_text, tokenizer, tokens, context, source="news tail")
    desc = (
        f"{where} tokens {start}..{start + cal.tokens} (after the {skip_tokens} evaluation "
        f"tokens and a {context}-token gap; re-tokenized), {cal.tokens} tokens in "
        f"{cal.windows.shape[0]} windows of {cal.context}, sha256 {cal.sha256[:12]}"
    )
    return CalibrationData(cal_text, cal, desc)


class _Lazy:
    """Runs `compute()` once, on the first layer asked for; then serves per-layer results."""

    def __init__(self, compute: Any) -> None:
        self.compute = compute
        self.results: dict[str, tuple[torch.Tensor, float]] | None = None

    def __call__(self, name: str, w: torch.Tensor) -> tuple[torch.Tensor, float]:
        if self.results is None:
            self.results = self.compute()
        assert self.results is not None
        if name not in self.results:
            raise KeyError(f"the calibrated pass produced no weight for {name!r}")
        w_hat, bits = self.results.pop(name)
        if not self.results:
            self.results = None  # a later run of the method computes afresh
        return w_hat, bits


def gptq_int4_method(model_dir: Path, data: CalibrationData) -> Method:
    def compute() -> dict[str, tuple[torch.Tensor, float]]:
        from higgs_engine.calibration import run_calibrated
        from higgs_engine.methods import METHODS, Precision
        from higgs_engine.model_structure import layer_specs, load_config
        from higgs_engine.safetensors_stream import CheckpointReader
        from higgs_engine.sources import resolve_model

        out: dict[str, tuple[torch.Tensor, float]] = {}
        int4 = Precision(bits=4, group_size=128)

        def quantize(
            group: list[Any], ws: list[torch.Tensor], h: torch.Tensor
        ) -> list[torch.Tensor]:
            # Layers sharing an input are swept together: rows never interact in GPTQ.
            res = METHODS["gptq-int4"].quantize_many(ws, int4, hessian=h)
            for spec, r in zip(group, res, strict=True):
                out[spec.name] = (r.w_hat, r.bits)
            return [r.w_hat for r in res]

        cfg = load_config(model_dir)
        with CheckpointReader(model_dir) as reader:
            specs = layer_specs(cfg, reader.keys())
            outside = run_calibrated(
                resolve_model(model_dir), reader, specs, data.calibration, quantize
            )
            for name in outside:  # outside the blocks (a pooler): plain RTN, said in params
                spec = next(s for s in specs if s.name == name)
                r = METHODS["rtn"].quantize(spec.weight(reader), int4)
                out[name] = (r.w_hat, r.bits)
        return out

    return Method(
        "GPTQ int4 g128",
        "gptq",
        {"bits": 4, "group_size": 128, "damp": 0.01, "calibration": data.description},
        layer_fn=_Lazy(compute),
    )


def _from_pipeline(
    model_dir: Path, config: Any, data: CalibrationData
) -> dict[str, tuple[torch.Tensor, float]]:
    """quantize_checkpoint with the calibration, dequantized artifact read back per layer."""
    from safetensors import safe_open

    from higgs_engine.model_structure import layer_specs, load_config
    from higgs_engine.pipeline import quantize_checkpoint

    with tempfile.TemporaryDirectory(prefix="higgs-cal-") as tmp:
        out = Path(tmp) / "out"
        rep = quantize_checkpoint(model_dir, out, config, calibration=data.calibration)
        specs = {s.name: s for s in layer_specs(load_config(model_dir))}
        res: dict[str, tuple[torch.Tensor, float]] = {}
        with safe_open(str(out / "dequantized" / "model.safetensors"), framework="pt") as f:
            keys = set(f.keys())
            for row in rep.layers:
                spec = specs[row.name]
                key = (
                    spec.key if spec.key in keys else next(k for k in keys if k.endswith(spec.key))
                )
                w = f.get_tensor(key).to(torch.float32)
                res[row.name] = (w.t().contiguous() if spec.transposed else w, float(row.bits))
    return res


def calibrated_higgs_method(model_dir: Path, data: CalibrationData, p: int, n: int) -> Method:
    from higgs_engine.planning.config import HiggsConfig

    cfg = HiggsConfig(p=p, n=n, formats=("dequantized",))
    return Method(
        f"calibrated HIGGS p={p} n={n}",
        "higgs-calibrated",
        {"p": p, "n": n, "calibration": data.description},
        layer_fn=_Lazy(lambda: _from_pipeline(model_dir, cfg, data)),
    )


def calibrated_dynamic_method(model_dir: Path, data: CalibrationData, avg_bits: float) -> Method:
    def compute() -> dict[str, tuple[torch.Tensor, float]]:
        from devtools.profiles import get_profile
        from higgs_engine.model_structure import quantizable_layers
        from higgs_engine.planning.config import HiggsConfig
        from higgs_engine.planning.plans import Target, config_with_allocation, plan_allocation
        from higgs_engine.planning.profile import ProfileConfig

        cal = data.calibration
        # metric "auto": KL for a causal LM, 1 - cos for an encoder (the engine decides)
        pcfg = ProfileConfig(
            metric="auto", method="fisher", context=cal.context, windows=int(cal.windows.shape[0])
        )
        base = HiggsConfig(formats=("dequantized",))
        prof = get_profile(model_dir, pcfg, text=data.text)
        plan = plan_allocation(
            prof, base, Target(avg_bits=avg_bits), names=quantizable_layers(model_dir)
        )
        return _from_pipeline(model_dir, config_with_allocation(base, plan.allocation), data)

    return Method(
        f"calibrated dynamic HIGGS {avg_bits:g} bits",
        "higgs-calibrated",
        {
            "avg_bits": avg_bits,
            "profile": "fisher (KL, or 1 - cos for an encoder) on the calibration text",
            "calibration": data.description,
        },
        layer_fn=_Lazy(compute),
    )


def calibrated_methods(model_dir: Path, data: CalibrationData) -> list[Method]:
    """The calibrated competitors, in table order."""
    return [
        gptq_int4_method(model_dir, data),
        calibrated_higgs_method(model_dir, data, 2, 256),
        calibrated_dynamic_method(model_dir, data, 3.5),
    ]
