"""Quality of a (quantized) model on a text: perplexity and KL divergence from a base model.

The text is tokenized once and cut into non-overlapping windows of `context` tokens; inside a
window every position predicts the next token, so a window scores context - 1 tokens.

    KL(base || model) = sum_v p_base(v) * (log p_base(v) - log p_model(v)),

averaged over all scored tokens. To compare many quantized models against one base model,
compute the base log-probs once with `base_log_probs` (kept in memory or in a directory) and
pass the result as `base` to `evaluate_model` for each model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.errors import InvalidConfigError
from higgs_engine.progress import ProgressCallback, report

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class EvalResult:
    ppl: float
    kl: float | None  # None when no base model was given
    tokens: int  # scored tokens: windows * (context - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_text(path: Path) -> str:
    """A UTF-8 text file's content; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise InvalidConfigError(f"text file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidConfigError(
            f"{str(path)!r} is not a UTF-8 text file ({exc.reason} at byte {exc.start})"
        ) from exc
    if "\x00" in text:
        raise InvalidConfigError(f"{str(path)!r} is not a text file (it contains NUL bytes)")
    if not text.strip():
        raise InvalidConfigError(f"text file {str(path)!r} is empty")
    return text


def tokenize(tokenizer: Any, text: str) -> torch.Tensor:
    """All token ids of `text` as one int64 tensor (no special tokens added)."""
    import torch

    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def text_windows(ids: torch.Tensor, context: int, windows: int) -> torch.Tensor:
    """The first `windows` non-overlapping windows of `context` tokens: (w, context) int64.

    Fewer windows are returned when the text is short; none at all is an error.
    """
    if context < 2:
        raise InvalidConfigError(f"context={context} must be at least 2 tokens")
    if windows < 1:
        raise InvalidConfigError(f"windows={windows} must be at least 1")
    available = ids.numel() // context
    if available == 0:
        raise InvalidConfigError(
            f"the text has {ids.numel()} tokens, fewer than one window of context={context}"
        )
    w = min(windows, available)
    return ids[: w * context].reshape(w, context)


def _log_probs(model: nn.Module, window: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax of the next-token logits for one window: (context - 1, vocab)."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=window.unsqueeze(0).to(device), use_cache=False)
    logits = out.logits[0, :-1].float()  # (context - 1, vocab): position i predicts token i+1
    return torch.log_softmax(logits, dim=-1).cpu()


class BaseLogProbs:
    """The base model's next-token log-probs per window, computed once and reused.

    Stored in `dtype` (float16 halves memory; KL then carries ~1e-3 relative rounding) either in
    memory or, with `cache_dir`, one safetensors file per window read back on demand.
    """

    def __init__(self, windows: torch.Tensor, cache_dir: Path | None = None) -> None:
        self.windows = windows
        self.cache_dir = cache_dir
        self._mem: list[torch.Tensor] = []

    def __len__(self) -> int:
        return int(self.windows.shape[0])

    def _file(self, i: int) -> Path:
        return Path(self.cache_dir or ".") / f"window_{i:05d}.safetensors"

    def _put(self, i: int, lp: torch.Tensor) -> None:
        if self.cache_dir is None:
            self._mem.append(lp)
        else:
            from safetensors.torch import save_file

            save_file({"log_probs": lp.contiguous()}, str(self._file(i)))

    def __getitem__(self, i: int) -> torch.Tensor:
        """float32 (context - 1, vocab) log-probs of window i."""
        import torch

        if self.cache_dir is None:
            return self._mem[i].to(torch.float32)
        from safetensors.torch import load_file

        return load_file(str(self._file(i)))["log_probs"].to(torch.float32)


def base_log_probs(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    cache_dir: Path | None = None,
    dtype: torch.dtype | None = None,
    progress: ProgressCallback | None = None,
) -> BaseLogProbs:
    """Run the base model once over `windows` and keep its log-probs for later KL figures."""
    import torch

    store_dtype = dtype if dtype is not None else torch.float32
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    base = BaseLogProbs(windows, cache_dir)
    total = int(windows.shape[0])
    model.eval()
    for i in range(total):
        report(progress, "evaluating", i, total)
        base._put(i, _log_probs(model, windows[i]).to(store_dtype))
    report(progress, "evaluating", total, total)
    return base


def _window_scores(
    lp: torch.Tensor, targets: torch.Tensor, base_lp: torch.Tensor | None
) -> tuple[float, float]:
    """(sum of NLL, sum of KL) over one window's scored tokens, in float64."""
    import torch

    nll = -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().sum().item()
    if base_lp is None:
        return nll, 0.0
    # (context - 1, vocab) -> per-token KL, summed
    kl = (base_lp.exp() * (base_lp - lp)).sum(-1).double()
    return nll, float(torch.clamp(kl, min=0.0).sum().item())


def evaluate_windows(
    model: nn.Module,
    windows: torch.Tensor,
    base: BaseLogProbs | nn.Module | None = None,
    progress: ProgressCallback | None = None,
) -> EvalResult:
    """Perplexity of `model` over `windows` and, with `base`, the mean KL(base || model).

    `base` is either precomputed `BaseLogProbs` (for the same windows) or a base model, run
    alongside window by window.
    """
    from torch import nn

    if isinstance(base, BaseLogProbs) and (
        base.windows.shape != windows.shape or not bool((base.windows == windows).all())
    ):
        raise InvalidConfigError("the base log-probs were computed on different windows")
    total = int(windows.shape[0])
    model.eval()
    if isinstance(base, nn.Module):
        base.eval()
    nll_sum = kl_sum = 0.0
    for i in range(total):
        report(progress, "evaluating", i, total)
        lp = _log_probs(model, windows[i])
        base_lp: torch.Tensor | None = None
        if isinstance(base, BaseLogProbs):
            base_lp = base[i]
        elif isinstance(base, nn.Module):
            base_lp = _log_probs(base, windows[i])
        nll, kl = _window_scores(lp, windows[i, 1:], base_lp)
        nll_sum += nll
        kl_sum += kl
    report(progress, "evaluating", total, total)
    tokens = total * (int(windows.shape[1]) - 1)
    return EvalResult(
        ppl=math.exp(nll_sum / tokens),
        kl=kl_sum / tokens if base is not None else None,
        tokens=tokens,
    )


def evaluate_model(
    model: nn.Module,
    tokenizer: Any,
    text: str,
    *,
    context: int = 512,
    windows: int = 40,
    base: BaseLogProbs | nn.Module | None = None,
    progress: ProgressCallback | None = None,
) -> EvalResult:
    """Tokenize `text`, cut it into windows and call `evaluate_windows`."""
    wins = text_windows(tokenize(tokenizer, text), context, windows)
    return evaluate_windows(model, wins, base, progress)


def compare_to_base(
    base_dir: Path,
    quantized_dir: Path,
    text: str,
    *,
    context: int = 512,
    windows: int = 16,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Perplexity of the base checkpoint and of a quantized artifact (native, dequantized or a
    compressed-tensors directory, each loaded as its users load it: higgs_engine.artifacts),
    and KL(base || quantized), on the same windows of `text` (never longer than the positions
    the model was built for): {"ppl_base", "ppl_quantized", "kl", "eval_tokens",
    "eval_context", "eval_windows"}."""
    from higgs_engine.artifacts import load_model

    base, tokenizer = load_model(base_dir)
    if tokenizer is None:
        raise InvalidConfigError(f"an evaluation needs a tokenizer; {base_dir} has none")
    context = min(context, int(getattr(base.config, "max_position_embeddings", None) or context))
    wins = text_windows(tokenize(tokenizer, text), context, windows)
    base_lp = base_log_probs(base, wins, progress=progress)
    base_res = evaluate_windows(base, wins, None, progress)
    del base
    quant, _ = load_model(quantized_dir)
    q_res = evaluate_windows(quant, wins, base_lp, progress)
    return {
        "ppl_base": base_res.ppl,
        "ppl_quantized": q_res.ppl,
        "kl": q_res.kl,
        "eval_tokens": q_res.tokens,
        "eval_context": int(wins.shape[1]),
        "eval_windows": int(wins.shape[0]),
    }
