"""GGUF jobs in the worker (options.formats ["gguf"]): the engine's quantize_gguf with the
service's profile stores, the job's target and, with options.evaluate, the worker's evaluation
text run in llama.cpp.

    resolving / converting / profiling / measuring / allocating / quantizing / evaluating /
    packaging, as higgs_engine.gguf.run describes; the profile (token embedding and head
    included) is found in or saved to the profiles table like a dynamic job's.

A GGUF job never fans out: llama.cpp's converter reads the whole checkpoint in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.plans import Target
from higgs_engine.progress import ProgressCallback
from higgs_engine.report import Report
from worker.dynamic import ProfileSettings, SessionFactory, profile_revision, profile_stores
from worker.models import ModelSource


def quantize_gguf_job(
    sessions: SessionFactory,
    source: ModelSource,
    requested_revision: str | None,
    out: Path,
    target: dict[str, float],
    ps: ProfileSettings | None,
    progress: ProgressCallback,
    *,
    eval_text_file: Path | None = None,
    eval_context: int | None = None,
    eval_windows: int | None = None,
    rotate: str | None = None,
) -> Report:
    """The GGUF file of the job into `out`/gguf with `out`/report.json."""
    from higgs_engine.evaluate import read_text
    from higgs_engine.gguf.run import GgufEvalRequest, GgufRun, quantize_gguf

    kind, value = next(iter(target.items()))
    kw: dict[str, Any] = {}
    if kind == "bits":
        kw["bits"] = float(value)
    else:
        if ps is None:
            raise InvalidConfigError("this worker has no profile settings for dynamic targets")
        kw.update(
            target=Target(**{kind: float(value)}),
            profile_config=ps.engine_config(),
            profile_text=ps.text(),
            stores=profile_stores(sessions, source, requested_revision, ps),
            selfgen_cache=ps.cache_dir,
        )
    evaluate = None
    if eval_text_file is not None:
        evaluate = GgufEvalRequest(
            read_text(eval_text_file),
            eval_text_file.name,
            context=eval_context,
            windows=eval_windows,
        )
    if rotate is not None:
        kw["rotate"] = rotate
    report = quantize_gguf(GgufRun(source.path, out, progress=progress, evaluate=evaluate, **kw))
    if kind != "bits":
        report.metrics.setdefault("service", {})["profile"] = {"revision": profile_revision(source)}
    return report
