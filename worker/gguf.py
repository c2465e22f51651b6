"""GGUF jobs in the worker (options.formats ["gguf"]): the engine's job (higgs_engine.job,
GgufOptions) with the service's profile stores, the job's target and, with options.evaluate,
the worker's evaluation text run in llama.cpp.

    resolving / converting / profiling / measuring / allocating / quantizing / evaluating /
    packaging, as higgs_engine.gguf.run describes; the profile (token embedding and head
    included) is found in or saved to the profiles table like a dynamic job's.

A GGUF job never fans out: llama.cpp's converter reads the whole checkpoint in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.plans import Target
from higgs_engine.progress import ProgressCallback
from higgs_engine.report import Report
from higgs_engine.sources import SourceIdentity
from worker.dynamic import ProfileSettings, SessionFactory, job_profile_source, profile_revision


def quantize_gguf_job(
    sessions: SessionFactory,
    source: SourceIdentity,
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
    annotate: Callable[[Report, Path], None] | None = None,
) -> Report:
    """The GGUF file of the job into `out`/gguf with `out`/report.json, written once with the
    service's profile entry and then `annotate`'s (the caller's) in it."""
    from higgs_engine.evaluate import read_text
    from higgs_engine.gguf.run import DEFAULT_ROTATE, GgufEvalRequest
    from higgs_engine.job import GgufOptions, ProfileSource, QuantizeJob, run

    kind, value = next(iter(target.items()))
    bits = None
    planning_target = None
    profile = ProfileSource()
    if kind == "bits":
        bits = float(value)
    else:
        if ps is None:
            raise InvalidConfigError("this worker has no profile settings for dynamic targets")
        planning_target = Target(**{kind: float(value)})
        # the dynamic jobs' profile source (a GGUF run takes its profile from it; the menu is
        # llama.cpp's types)
        profile = job_profile_source(sessions, source, requested_revision, None, ps)
    evaluate = None
    if eval_text_file is not None:
        evaluate = GgufEvalRequest(
            read_text(eval_text_file),
            eval_text_file.name,
            context=eval_context,
            windows=eval_windows,
        )

    def annotate_job(report: Report, staged: Path) -> None:
        if planning_target is not None:
            report.metrics.setdefault("service", {})["profile"] = {
                "revision": profile_revision(source)
            }
        if annotate is not None:
            annotate(report, staged)

    job = QuantizeJob(
        source.path,
        target=planning_target,
        profile=profile,
        gguf=GgufOptions(bits=bits, rotate=rotate or DEFAULT_ROTATE, evaluate=evaluate),
        annotate=annotate_job,
    )
    return run(job, out, progress)
