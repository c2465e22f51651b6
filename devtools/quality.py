"""Quality measurement shared by the benchmarks (benchmarks/quality.py, dynamic.py, speed.py,
rtn_crosscheck.py) and the CI quality check (tests/engine/test_quality_real.py).

- the competitors (HIGGS, RTN, NF4, HQQ) as one `Method` type: W (out, in) -> (W_hat, bits);
- simulated quantization of a model in memory: every selected nn.Linear weight is replaced by
  the method's dequantized W_hat (rounded to float16, which is exactly what the dequantized
  artifact stores), the original weights kept aside to restore;
- the two quality evaluators: a causal LM (perplexity and KL from the base model through
  higgs_engine.evaluate, base log-probs computed once) and a sentence-embedding model
  (mean 1 - cosine between base and quantized mean-pooled, L2-normalised embeddings).

Result writing (JSON + markdown + plots) is the benchmarks' own: benchmarks/common.py.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"
SMOLLM_DIR = DATA_DIR / "smollm2-135m"
MINILM_DIR = DATA_DIR / "minilm"
NEWS_FILE = DATA_DIR / "news.txt"

# The artifacts ship 16-bit weights; simulated W_hat is rounded the same way.
ARTIFACT_DTYPE = torch.float16


def data_ready() -> tuple[bool, str]:
    """Whether scripts/prepare_data.py has prepared data/; the reason when it has not."""
    missing = [
        str(p.relative_to(REPO_ROOT))
        for p in (SMOLLM_DIR / ".prepared", MINILM_DIR / ".prepared", NEWS_FILE)
        if not p.exists()
    ]
    if missing:
        return (
            False,
            f"real data not prepared (missing {missing}); run python scripts/prepare_data.py",
        )
    return True, ""


# --------------------------------------------------------------------------------------------
# Methods


QuantFn = Callable[[torch.Tensor], tuple[torch.Tensor, float]]


@dataclass(frozen=True)
class Method:
    """One competitor: `fn(W)` returns (W_hat float32 (out, in), total bits per weight).

    bits count every stored overhead of the layer (codes + scales/zeros as the method stores
    them); None for the base model.
    """

    name: str
    family: str  # base | rtn | nf4 | hqq | higgs
    params: dict[str, Any]
    fn: QuantFn | None = None
    # Methods that need the whole model (calibrated ones): `layer_fn(name, W)` instead of fn.
    layer_fn: Callable[[str, torch.Tensor], tuple[torch.Tensor, float]] | None = None


def higgs_fn(
    p: int,
    n: int,
    group_size: int = 256,
    rotation_block: int = 1024,
    sign_seed: int | None = None,
    scale_rule: str = "rms",
    scale_search: str = "table",
) -> QuantFn:
    def run(w: torch.Tensor) -> tuple[torch.Tensor, float]:
        from higgs_engine.quantize import MatrixSpec, dequantize_matrix, quantize_matrix

        spec = MatrixSpec(p, n, group_size, rotation_block, sign_seed, scale_rule)
        q = quantize_matrix(w, spec, scale_search=scale_search)
        return dequantize_matrix(q), float(q.bits_per_weight())

    return run


def higgs_default_fn(
    bits: float = 4.0, scale_search: str = "table"
) -> tuple[dict[str, Any], QuantFn]:
    """What `higgs quantize --bits B` does: HiggsConfig.from_bits(B) with every default
    (`scale_search="exact"`: with the exact multiplier search the table replaced)."""
    from higgs_engine.planning.config import HiggsConfig

    c = HiggsConfig.from_bits(bits)
    params: dict[str, Any] = {
        "p": c.p,
        "n": c.n,
        "group_size": c.group_size,
        "rotation_block": c.rotation_block,
        "sign_seed": c.sign_seed,
        "scale_rule": c.scale_rule,
    }
    if scale_search != "table":
        params["scale_search"] = scale_search
    fn = higgs_fn(c.p, c.n, c.group_size, c.rotation_block, c.sign_seed, c.scale_rule, scale_search)
    return params, fn


def rtn_fn(bits: int, group_size: int = 128) -> QuantFn:
    def run(w: torch.Tensor) -> tuple[torch.Tensor, float]:
        from higgs_engine.methods import METHODS, Precision

        res = METHODS["rtn"].quantize(w, Precision(bits=bits, group_size=group_size))
        return res.w_hat, res.bits

    return run


def nf4_fn(block_size: int = 64) -> QuantFn:
    def run(w: torch.Tensor) -> tuple[torch.Tensor, float]:
        from higgs_engine.methods import METHODS, Precision

        res = METHODS["nf4"].quantize(w, Precision(group_size=block_size))
        return res.w_hat, res.bits

    return run


def nf4_dq_fn(block_size: int = 64) -> QuantFn:
    """NF4 with the absmax constants double-quantized (bitsandbytes' bnb_4bit_use_double_quant)."""

    def run(w: torch.Tensor) -> tuple[torch.Tensor, float]:
        from higgs_engine.methods import METHODS, Precision

        res = METHODS["nf4-dq"].quantize(w, Precision(group_size=block_size))
        return res.w_hat, res.bits

    return run


def hqq_quantize(
    w: torch.Tensor,
    nbits: int,
    group_size: int = 64,
    *,
    optimize: bool = True,
    round_zero: bool = False,
) -> tuple[torch.Tensor, float]:
    """HQQ (the `hqq` package, CPU): W_hat and its honest bits per weight.

    Uses hqq's own Quantizer with its default half-quadratic optimisation (optimize=False,
    round_zero=True is plain min-max round-to-nearest: the RTN cross-check), groups of
    `group_size` along the input dimension (axis=1). HQQLinear keeps one scale and one zero per
    group in the float16 compute dtype, so both are rounded to float16 before dequantizing and
    counted as 2 x 16 bits per group: nbits + 32 / group_size (3.5 and 4.5 bits at g = 64).
    """
    from hqq.core.quantize import Quantizer

    if w.shape[1] % group_size:
        raise ValueError(
            f"HQQ needs in_features divisible by group_size={group_size}, got {tuple(w.shape)}"
        )
    w_q, meta = Quantizer.quantize(
        w.float(),
        nbits=nbits,
        channel_wise=True,
        group_size=group_size,
        optimize=optimize,
        round_zero=round_zero,
        axis=1,
        bitpack=False,
        compute_dtype=torch.float32,
        device="cpu",
    )
    meta = dict(meta)
    meta["scale"] = meta["scale"].to(torch.float16).to(torch.float32)
    meta["zero"] = meta["zero"].to(torch.float16).to(torch.float32)
    w_hat = Quantizer.dequantize(w_q, meta).reshape(w.shape).float()
    n_groups = w.numel() // group_size
    bits = nbits + n_groups * 32 / w.numel()
    return w_hat, bits


def hqq_fn(nbits: int, group_size: int = 64) -> QuantFn:
    def run(w: torch.Tensor) -> tuple[torch.Tensor, float]:
        return hqq_quantize(w, nbits, group_size)

    return run


def all_methods() -> list[Method]:
    """Every competitor of the quality benchmark, in table order."""
    return [
        Method("base", "base", {}),
        Method("RTN-3 g128", "rtn", {"bits": 3, "group_size": 128}, rtn_fn(3)),
        Method("RTN-4 g128", "rtn", {"bits": 4, "group_size": 128}, rtn_fn(4)),
        Method("NF4 b64", "nf4", {"block_size": 64}, nf4_fn(64)),
        Method("NF4 b64 dq", "nf4", {"block_size": 64, "double_quant": True}, nf4_dq_fn(64)),
        Method("HQQ-3 g64", "hqq", {"bits": 3, "group_size": 64}, hqq_fn(3)),
        Method("HQQ-4 g64", "hqq", {"bits": 4, "group_size": 64}, hqq_fn(4)),
        Method("HIGGS p=1 n=8", "higgs", {"p": 1, "n": 8}, higgs_fn(1, 8)),
        Method("HIGGS p=1 n=16", "higgs", {"p": 1, "n": 16}, higgs_fn(1, 16)),
        Method("HIGGS p=2 n=64", "higgs", {"p": 2, "n": 64}, higgs_fn(2, 64)),
        Method("HIGGS p=2 n=256", "higgs", {"p": 2, "n": 256}, higgs_fn(2, 256)),
        Method("HIGGS p=2 n=512", "higgs", {"p": 2, "n": 512}, higgs_fn(2, 512)),
        Method("HIGGS p=2 n=1024", "higgs", {"p": 2, "n": 1024}, higgs_fn(2, 1024)),
        Method("HIGGS default --bits 4", "higgs", *higgs_default_fn(4.0)),
    ]


def select_methods(names: Sequence[str] | None, extra: Sequence[Method] = ()) -> list[Method]:
    """The named methods of `all_methods()` + `extra` (model-specific ones), default all."""
    methods = all_methods() + list(extra)
    if not names:
        return methods
    by_name = {m.name: m for m in methods}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {list(by_name)}")
    return [by_name[n] for n in names]


# --------------------------------------------------------------------------------------------
# Simulated quantization of a model in memory


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every nn.Linear of the model except its output head (and weights tied to an embedding)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and mod is not head and id(mod.weight) not in emb
    ]


@dataclass
class QuantStats:
    bits: float | None  # numel-weighted total bits per weight over the quantized layers
    rel_error: float | None  # numel-weighted mean of t^2 = ||W_hat - W||^2 / ||W||^2
    seconds: float  # wall time of the method over all layers (quantize + dequantize)
    layers: int
    weights: int
    per_layer: list[dict[str, Any]] = field(default_factory=list)
    cpu_seconds: float = 0.0  # process CPU time over the same calls (less sensitive to load)
    peak_rss_mib: float | None = None  # the process's peak RSS while the method ran
    rss_before_mib: float | None = None  # its RSS before (the model, the evaluation data)


def _status_mib(field: str) -> float | None:
    """A /proc/self/status memory field (VmRSS, VmHWM) in MiB; None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux: /proc/self/clear_refs
    "5"), so the next VmHWM read is the peak since now. False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class SimulatedModel:
    """A model whose selected linear weights can be swapped for a method's W_hat and restored."""

    def __init__(self, model: nn.Module, layers: list[tuple[str, nn.Linear]] | None = None) -> None:
        self.model = model.eval()
        self.layers = layers if layers is not None else linear_layers(model)
        self.originals = {name: mod.weight.detach().clone().float() for name, mod in self.layers}

    @property
    def weights(self) -> int:
        return sum(w.numel() for w in self.originals.values())

    def restore(self) -> None:
        with torch.no_grad():
            for name, mod in self.layers:
                mod.weight.copy_(self.originals[name].to(mod.weight.dtype))

    def apply(self, method: Method, keep_per_layer: bool = False) -> QuantStats:
        """Replace every layer's weight by the method's W_hat (as float16, then the model dtype)."""
        self.restore()
        if method.fn is None and method.layer_fn is None:
            return QuantStats(None, None, 0.0, len(self.layers), self.weights)
        bits_sum = err_sum = 0.0
        total = 0
        per_layer = []
        elapsed = cpu = 0.0
        rss_before = _status_mib("VmRSS")
        peak_ok = reset_peak_rss()
        with torch.no_grad():
            for name, mod in self.layers:
                w = self.originals[name]
                t0, c0 = time.perf_counter(), time.process_time()
                if method.layer_fn is not None:
                    w_hat, bpw = method.layer_fn(name, w)
                else:
                    assert method.fn is not None
                    w_hat, bpw = method.fn(w)
                elapsed += time.perf_counter() - t0
                cpu += time.process_time() - c0
                w_hat = w_hat.to(ARTIFACT_DTYPE).to(torch.float32)
                t2 = float(((w_hat - w).double().pow(2).sum() / w.double().pow(2).sum()).item())
                n = w.numel()
                bits_sum += bpw * n
                err_sum += t2 * n
                total += n
                if keep_per_layer:
                    per_layer.append(
                        {"name": name, "shape": list(w.shape), "bits": bpw, "rel_error": t2}
                    )
                mod.weight.copy_(w_hat.to(mod.weight.dtype))
        return QuantStats(
            bits_sum / total,
            err_sum / total,
            elapsed,
            len(self.layers),
            total,
            per_layer,
            cpu,
            _status_mib("VmHWM") if peak_ok else None,
            rss_before,
        )


# --------------------------------------------------------------------------------------------
# Loading the real models (offline)


def load_causal_lm(path: Path) -> tuple[nn.Module, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok


def load_encoder(path: Path) -> tuple[nn.Module, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok


# --------------------------------------------------------------------------------------------
# Evaluators


def smollm2_on_news(
    context: int, windows: int
) -> tuple[nn.Module, Any, str, CausalLMEval, dict[str, float], SimulatedModel]:
    """SmolLM2-135M with its base figures on the first `windows` news windows: (model,
    tokenizer, news text, evaluator, base figures, the model's quantizable layers)."""
    model, tok = load_causal_lm(SMOLLM_DIR)
    text = NEWS_FILE.read_text(encoding="utf-8")
    ev = CausalLMEval(tok, text, context, windows)
    base = ev.prepare_base(model)
    return model, tok, text, ev, base, SimulatedModel(model)


class CausalLMEval:
    """Perplexity and KL(base || model) on the first `windows` windows of `context` tokens.

    The base model's log-probs are computed once (float16 in memory) by `prepare_base`; every
    later `evaluate` runs only the quantized model. Uses higgs_engine.evaluate, the code behind
    `higgs eval`.
    """

    def __init__(self, tokenizer: Any, text: str, context: int = 512, windows: int = 40) -> None:
        from higgs_engine.evaluate import text_windows, tokenize

        self.windows = text_windows(tokenize(tokenizer, text), context, windows)
        self.base: Any = None

    @classmethod
    def from_windows(cls, windows: torch.Tensor) -> CausalLMEval:
        """The same evaluation on given (windows, context) token ids (e.g. generated text)."""
        ev = cls.__new__(cls)
        ev.windows = windows
        ev.base = None
        return ev

    def prepare_base(self, model: nn.Module, check: bool = False) -> dict[str, float]:
        """Store the base log-probs; return the base perplexity from them (KL 0 by definition).

        With `check`, the base model is also run again through `evaluate` (KL ~ 0 then tests
        the evaluation path itself, at the cost of a second pass).
        """
        from higgs_engine.evaluate import base_log_probs

        self.base = base_log_probs(model, self.windows, dtype=torch.float16)
        if check:
            return self.evaluate(model)
        nll = 0.0
        for i in range(len(self.base)):
            lp = self.base[i]  # (context - 1, vocab)
            nll -= float(lp.gather(-1, self.windows[i, 1:, None]).double().sum().item())
        tokens = int(self.windows.shape[0]) * (int(self.windows.shape[1]) - 1)
        return {"ppl": math.exp(nll / tokens), "kl": 0.0, "tokens": tokens}

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        from higgs_engine.evaluate import evaluate_windows

        if self.base is None:
            raise RuntimeError("prepare_base must run first")
        res = evaluate_windows(model, self.windows, self.base)
        return {"ppl": res.ppl, "kl": float(res.kl or 0.0), "tokens": res.tokens}


_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])[\"')]*\s+(?=[\"'(]?[A-Z0-9])")


def news_sentences(text: str, count: int, min_words: int = 4) -> list[str]:
    """The first `count` sentences of the news text (one document per line), split on
    sentence boundaries; fragments shorter than `min_words` words are dropped."""
    out: list[str] = []
    for doc in text.splitlines():
        for sent in _SENTENCE_SPLIT.split(doc.strip()):
            sent = sent.strip()
            if len(sent.split()) >= min_words:
                out.append(sent)
                if len(out) == count:
                    return out
    if len(out) < count:
        raise ValueError(f"the text has only {len(out)} sentences, fewer than {count}")
    return out


class EmbeddingEval:
    """Mean 1 - cos(base, quantized) of mean-pooled, L2-normalised sentence embeddings."""

    def __init__(
        self, tokenizer: Any, sentences: list[str], batch_size: int = 64, max_length: int = 256
    ) -> None:
        # Sorted by length so that a batch pads little; the mean over sentences is order-free.
        order = sorted(range(len(sentences)), key=lambda i: len(tokenizer.tokenize(sentences[i])))
        ordered = [sentences[i] for i in order]
        self.batches = [
            tokenizer(
                ordered[i : i + batch_size],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
            for i in range(0, len(ordered), batch_size)
        ]
        self.count = len(sentences)
        self.base: torch.Tensor | None = None

    def embed(self, model: nn.Module) -> torch.Tensor:
        outs = []
        with torch.inference_mode():
            for batch in self.batches:
                hidden = model(**batch).last_hidden_state  # (b, t, d)
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (b, t, 1)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (b, d)
                outs.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
        return torch.cat(outs)  # (sentences, d)

    def prepare_base(self, model: nn.Module, check: bool = False) -> dict[str, float]:
        self.base = self.embed(model)
        if check:
            return self.evaluate(model)
        return {"one_minus_cos": 0.0, "sentences": self.count}

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        if self.base is None:
            raise RuntimeError("prepare_base must run first")
        emb = self.embed(model)
        cos = (emb.double() * self.base.double()).sum(-1).clamp(-1.0, 1.0)
        return {"one_minus_cos": float((1.0 - cos).mean().item()), "sentences": self.count}


def run_methods(
    sim: SimulatedModel,
    evaluator: CausalLMEval | EmbeddingEval,
    methods: Sequence[Method],
    log: Callable[[str], None] = print,
    check_base: bool = False,
    keep_going: bool = False,
    on_row: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Apply each method in turn to the same model and evaluate it on the same data.

    The base method must come first: it stores the base outputs the others are compared to.
    With `keep_going`, a method that raises gets a row with its error and the run goes on.
    """
    rows: list[dict[str, Any]] = []
    for m in methods:
        try:
            stats = sim.apply(m)
        except Exception as exc:
            if not keep_going:
                raise
            rows.append(
                {
                    "method": m.name,
                    "family": m.family,
                    "params": m.params,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )
            log(f"{m.name}: FAILED {rows[-1]['error']}")
            if on_row is not None:
                on_row(rows)
            continue
        t0 = time.perf_counter()
        metrics = (
            evaluator.prepare_base(sim.model, check_base)
            if m.fn is None and m.layer_fn is None
            else evaluator.evaluate(sim.model)
        )
        eval_s = time.perf_counter() - t0
        row = {
            "method": m.name,
            "family": m.family,
            "params": m.params,
            "bits": stats.bits,
            "rel_error": stats.rel_error,
            "quant_seconds": stats.seconds,
            "quant_cpu_seconds": stats.cpu_seconds,
            "peak_rss_mib": stats.peak_rss_mib,
            "rss_before_mib": stats.rss_before_mib,
            "eval_seconds": eval_s,
            "layers": stats.layers,
            "weights": stats.weights,
            **metrics,
        }
        rows.append(row)
        log(format_row(row))
        if on_row is not None:
            on_row(rows)
    sim.restore()
    return rows


def format_row(row: dict[str, Any]) -> str:
    parts = [f"{row['method']:<18}"]
    for k in ("bits", "rel_error", "ppl", "kl", "one_minus_cos", "quant_seconds"):
        v = row.get(k)
        if v is not None:
            parts.append(f"{k}={v:.4g}")
    return "  ".join(parts)
