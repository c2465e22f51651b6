"""Quality of a GGUF file measured in llama.cpp itself, against the 16-bit GGUF of the same
checkpoint on the same tokens.

Causal LMs: perplexity of both and the mean per-token KL(base || quantized) over non-overlapping
windows of `context` tokens of the text (llama.cpp's tokenizer; every position predicts the next
token). Encoders (a BERT sentence encoder): the mean over windows of 1 - cos between the two
models' mean-pooled embeddings; each window is `context` tokens of the text framed by the
model's own special tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from higgs_engine.errors import InvalidConfigError
from higgs_engine.gguf.llama import LlamaModel
from higgs_engine.gguf.plan import context_length
from higgs_engine.progress import ProgressCallback, report


@dataclass(frozen=True)
class GgufEval:
    metric: str  # "kl" (causal) or "cos" (encoder)
    windows: int
    context: int
    tokens: int
    ppl_base: float | None = None
    ppl_quantized: float | None = None
    kl: float | None = None
    one_minus_cos: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "eval_engine": "llama.cpp",
            "eval_windows": self.windows,
            "eval_context": self.context,
            "eval_tokens": self.tokens,
        }
        if self.metric == "kl":
            d.update(ppl_base=self.ppl_base, ppl_quantized=self.ppl_quantized, kl=self.kl)
        else:
            d["one_minus_cos"] = self.one_minus_cos
        return d

    @property
    def measured(self) -> float:
        """The profile metric's measured change (KL, or 1 - cos)."""
        v = self.kl if self.metric == "kl" else self.one_minus_cos
        assert v is not None
        return v


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    m: np.ndarray = x64.max(axis=-1, keepdims=True)
    out: np.ndarray = x64 - m - np.log(np.exp(x64 - m).sum(axis=-1, keepdims=True))
    return out


def token_windows(tokens: list[int], context: int, windows: int) -> list[list[int]]:
    """The first `windows` non-overlapping windows of `context` tokens."""
    if context < 2:
        raise InvalidConfigError(f"context={context} must be at least 2", field="context")
    n = min(windows, len(tokens) // context)
    if n < 1:
        raise InvalidConfigError(
            f"the text has {len(tokens)} tokens, fewer than one window of {context}",
            field="text",
        )
    return [tokens[i * context : (i + 1) * context] for i in range(n)]


def evaluate_causal(
    quantized: Path,
    base: Path,
    text: str,
    *,
    context: int = 512,
    windows: int = 8,
    threads: int = 0,
    progress: ProgressCallback | None = None,
) -> GgufEval:
    with LlamaModel(base, n_ctx=context, threads=threads) as mb:
        toks = mb.tokenize(text)
        wins = token_windows(toks, context, windows)
        with LlamaModel(quantized, n_ctx=context, threads=threads) as mq:
            if mq.n_vocab != mb.n_vocab:
                raise InvalidConfigError(
                    f"{quantized.name} has {mq.n_vocab} tokens, the base {mb.n_vocab}"
                )
            nll_b = nll_q = kl = 0.0
            count = 0
            report(progress, "evaluating", 0, len(wins))
            for i, w in enumerate(wins):
                lb = _log_softmax(mb.logits(w))[:-1]  # (T-1, vocab)
                lq = _log_softmax(mq.logits(w))[:-1]
                nxt = np.asarray(w[1:])
                rows = np.arange(len(nxt))
                nll_b -= float(lb[rows, nxt].sum())
                nll_q -= float(lq[rows, nxt].sum())
                kl += float((np.exp(lb) * (lb - lq)).sum())
                count += len(nxt)
                report(progress, "evaluating", i + 1, len(wins))
    return GgufEval(
        "kl",
        len(wins),
        context,
        count,
        ppl_base=math.exp(nll_b / count),
        ppl_quantized=math.exp(nll_q / count),
        kl=kl / count,
    )


def evaluate_encoder(
    quantized: Path,
    base: Path,
    text: str,
    *,
    context: int = 128,
    windows: int = 32,
    threads: int = 0,
    progress: ProgressCallback | None = None,
) -> GgufEval:
    limit = context_length(base)
    # an encoder's learned positions end at n_ctx_train: the window and its framing fit there
    if limit:
        context = min(context, limit - 2)
    with LlamaModel(base, n_ctx=context + 2, embeddings=True, threads=threads) as mb:
        inner = mb.tokenize(text, add_special=False)
        wins = token_windows(inner, context, windows)
        framed = [mb.tokenize_framed(w) for w in wins]
        with LlamaModel(quantized, n_ctx=context + 2, embeddings=True, threads=threads) as mq:
            total = 0.0
            report(progress, "evaluating", 0, len(framed))
            for i, w in enumerate(framed):
                a = mb.pooled(w).astype(np.float64)
                b = mq.pooled(w).astype(np.float64)
                cos = float(a @ b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-30)
                total += 1.0 - cos
                report(progress, "evaluating", i + 1, len(framed))
    return GgufEval(
        "cos", len(framed), context, sum(len(w) for w in framed), one_minus_cos=total / len(framed)
    )


def evaluate_gguf(
    quantized: Path,
    base: Path,
    text: str,
    *,
    encoder: bool,
    context: int | None = None,
    windows: int | None = None,
    threads: int = 0,
    progress: ProgressCallback | None = None,
) -> GgufEval:
    """evaluate_encoder or evaluate_causal with their defaults where None."""
    if encoder:
        return evaluate_encoder(
            quantized,
            base,
            text,
            context=context or 128,
            windows=windows or 32,
            threads=threads,
            progress=progress,
        )
    return evaluate_causal(
        quantized,
        base,
        text,
        context=context or 512,
        windows=windows or 8,
        threads=threads,
        progress=progress,
    )
