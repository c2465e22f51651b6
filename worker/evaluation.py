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
    base_dir: Path, artifact_dir: Path, settings: EvalSettings, progress: ProgressCallback | None
) -> dict[str, Any]:
    """{"ppl_base", "ppl_quantized", "kl", "eval_tokens", ...} for report.metrics: the
    artifact in `artifact_dir` (native, or a compressed-tensors directory) against the base on
    the worker's evaluation text (higgs_engine.evaluate.compare_to_base)."""
    from higgs_engine.evaluate import compare_to_base, read_text

    if settings.text_file is None:
        raise InvalidConfigError(
            f"options.evaluate=true needs an evaluation text on the worker; set {EVAL_TEXT_ENV}"
        )
    text = read_text(settings.text_file)
    found = compare_to_base(
        base_dir,
        artifact_dir,
        text,
        context=settings.context,
        windows=settings.windows,
        progress=progress,
    )
    return {**found, "eval_text": settings.text_file.name}
