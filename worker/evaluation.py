"""The job's optional evaluation (options.evaluate): perplexity of the base model and of the
quantized native artifact, and KL(base || quantized), on the service's evaluation text.

The text is a worker setting (HIGGS_EVAL_TEXT_FILE); a job asking for evaluation on a worker
without one fails with invalid_config rather than silently skipping the figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from higgs_engine.errors import InvalidConfigError
from higgs_engine.progress import ProgressCallback

EVAL_TEXT_ENV = "HIGGS_EVAL_TEXT_FILE"


@dataclass(frozen=True)
class EvalSettings:
    text_file: Path | None
    context: int = 512
    windows: int = 16


def evaluate_artifact(
    base_dir: Path, native_dir: Path, settings: EvalSettings, progress: ProgressCallback | None
) -> dict[str, Any]:
    """{"ppl_base", "ppl_quantized", "kl", "eval_tokens", ...} for report.metrics."""
    from higgs_engine.artifacts import load_model
    from higgs_engine.evaluate import (
        base_log_probs,
        evaluate_windows,
        read_text,
        text_windows,
        tokenize,
    )

    if settings.text_file is None:
        raise InvalidConfigError(
            f"options.evaluate=true needs an evaluation text on the worker; set {EVAL_TEXT_ENV}"
        )
    text = read_text(settings.text_file)
    base, tokenizer = load_model(base_dir)
    if tokenizer is None:
        raise InvalidConfigError(f"options.evaluate=true needs a tokenizer; {base_dir} has none")
    # Never beyond the positions the model was built for.
    context = min(
        settings.context,
        int(getattr(base.config, "max_position_embeddings", None) or settings.context),
    )
    wins = text_windows(tokenize(tokenizer, text), context, settings.windows)
    base_lp = base_log_probs(base, wins, progress=progress)
    base_res = evaluate_windows(base, wins, None, progress)
    del base
    quant, _ = load_model(native_dir)
    q_res = evaluate_windows(quant, wins, base_lp, progress)
    return {
        "ppl_base": base_res.ppl,
        "ppl_quantized": q_res.ppl,
        "kl": q_res.kl,
        "eval_tokens": q_res.tokens,
        "eval_text": settings.text_file.name,
        "eval_context": int(wins.shape[1]),
        "eval_windows": int(wins.shape[0]),
    }
