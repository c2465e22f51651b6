"""GGUF jobs in the worker (options.formats ["gguf"]): the engine's job (higgs_engine.job,
GgufOptions) with the service's profile stores, the job's target and, with options.evaluate,
the worker's evaluation text run in llama.cpp, on the worker's device and threads.

    resolving / converting / profiling / measuring / allocating / quantizing / evaluating /
    packaging, as higgs_engine.gguf.run describes; the profile (token embedding and head
    included) is found in or saved to the profiles table like a dynamic job's, and measured on
    the worker's device (a GPU worker profiles on its GPU).

A GGUF job never fans out: llama.cpp's converter reads the whole checkpoint in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.plans import Target
from higgs_engine.progress import ProgressCallback
from higgs_engine.report import Report
from higgs_engine.sources import SourceIdentity
from worker.config import RunnerConfig
from worker.dynamic import ProfileSettings, SessionFactory, job_profile_source, profile_revision


@dataclass(frozen=True)
class GgufJob:
    """One GGUF job as the worker runs it: the model as resolved, the revision the job asked
    for, its target ({"bits": b}, {"avg_bits": b} or {"max_ppl_increase": x}),
    options.gguf_rotate (None: off) and options.evaluate."""

    source: SourceIdentity
    requested_revision: str | None
    target: Mapping[str, float]
    rotate: str | None = None
    evaluate: bool = False


@dataclass(frozen=True)
class GgufWorker:
    """What a GGUF job takes from its worker: the profile settings (None: no dynamic targets),
    the evaluation text and its windows, the device the profile runs on (None: the CPU) and
    the threads llama.cpp measures, quantizes and evaluates with (0: every core)."""

    profiles: ProfileSettings | None = None
    eval_text_file: Path | None = None
    eval_context: int | None = None
    eval_windows: int | None = None
    device: str | None = None
    threads: int = 0

    @classmethod
    def of(cls, cfg: RunnerConfig) -> GgufWorker:
        return cls(cfg.profiles, cfg.eval_text_file, cfg.eval_context, cfg.eval_windows, cfg.device)


def quantize_gguf_job(
    sessions: SessionFactory,
    job: GgufJob,
    worker: GgufWorker,
    out: Path,
    progress: ProgressCallback,
    annotate: Callable[[Report, Path], None] | None = None,
) -> Report:
    """The GGUF file of the job into `out`/gguf with `out`/report.json, written once with the
    service's profile entry and then `annotate`'s (the caller's) in it."""
    from higgs_engine.evaluate import read_text
    from higgs_engine.gguf.runplan import DEFAULT_ROTATE, GgufEvalRequest
    from higgs_engine.job import GgufOptions, ProfileSource, QuantizeJob, run

    kind, value = next(iter(job.target.items()))
    bits = None
    planning_target = None
    profile = ProfileSource()
    if kind == "bits":
        bits = float(value)
    else:
        if worker.profiles is None:
            raise InvalidConfigError("this worker has no profile settings for dynamic targets")
        planning_target = Target(**{kind: float(value)})
        # the dynamic jobs' profile source (a GGUF run takes its profile from it; the menu is
        # llama.cpp's types)
        profile = job_profile_source(
            sessions, job.source, job.requested_revision, None, worker.profiles
        )
    evaluate = None
    if job.evaluate and worker.eval_text_file is not None:
        evaluate = GgufEvalRequest(
            read_text(worker.eval_text_file),
            worker.eval_text_file.name,
            context=worker.eval_context,
            windows=worker.eval_windows,
        )

    def annotate_job(report: Report, staged: Path) -> None:
        if planning_target is not None:
            report.metrics.setdefault("service", {})["profile"] = {
                "revision": profile_revision(job.source)
            }
        if annotate is not None:
            annotate(report, staged)

    options = GgufOptions(
        bits=bits,
        rotate=job.rotate or DEFAULT_ROTATE,
        evaluate=evaluate,
        threads=worker.threads,
    )
    engine_job = QuantizeJob(
        job.source.path,
        target=planning_target,
        profile=profile,
        device=worker.device,
        gguf=options,
        annotate=annotate_job,
    )
    return run(engine_job, out, progress)
