"""The runner: everything one job attempt does, from claim to published artifacts.

    claim (compare-and-set queued -> running; worker.attempt)
      -> resolve the model (local name under models_dir, or Hub id pinned to a commit sha)
      -> a sharded source may fan out into parts here (worker.fanout); otherwise:
      -> the engine's entry point with the job's QuantizeJob, with a progress callback
         (worker.progress) that writes stage / progress / heartbeat and asks the engine to
         stop when cancel was requested; the service's report entries (and options.evaluate's
         metrics, measured on the staged native artifact) go in through the job's annotate,
         before report.json is written
      -> publish the artifacts (one rename, or an upload under a key no row names yet) with
         a sha256 per file (worker.publish)
      -> app.jobs.state.succeed (report, layers, artifact rows in one transaction)

Failures become a job error code (HiggsError.code for the engine's typed errors). A full
artifacts volume or an unreachable artifact store puts the job back in the queue instead
(worker.storage). A cancelled, failed or lost attempt leaves nothing under the published
artifact directory.

Directory layout under artifacts_dir (worker.staging, worker.publish):
    .staging/<job_id>.<attempt>.<hex>/   the engine writes here (never served)
    <job_id>/<attempt>.<hex>/<format>/   published attempt, referenced by the artifact rows
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.exc import DBAPIError

from app.artifacts.store import StoreUnavailableError
from app.jobs import state
from app.jobs.job_config import JobConfig
from higgs_engine.errors import CancelledError, InvalidConfigError
from higgs_engine.planning.ct_targets import CT_FORMAT
from worker.attempt import (
    Attempt,
    Dispatch,
    Outcome,
    claim_job,
    default_worker_id,
    fail_job,
    stop_job,
)
from worker.calibration import load_job_calibration
from worker.config import RunnerConfig
from worker.dbretry import DatabaseUnavailableError, SessionFactory, is_transient, retry_db
from worker.dynamic import annotate_uniform, job_menu_p, job_profile_source, profile_entry
from worker.evaluation import EVAL_TEXT_ENV, EvalSettings, evaluate_artifact
from worker.messages import is_storage_full
from worker.models import ModelRequest, describe_located, job_hub_token, locate
from worker.progress import ProgressWriter, heartbeating
from worker.publish import publish_result, remove_empty_job_dir
from worker.scratch import DiskGuard, note_reclaimed, reclaim_failed
from worker.staging import clear_stale_staging, remove_tree, staging_dir
from worker.storage import storage_recovered, wait_for_storage, wait_for_store

if TYPE_CHECKING:
    from higgs_engine.job import Annotate, JobPlan, QuantizeJob
    from higgs_engine.report import Report
    from higgs_engine.sources import ResolvedModel, ResolvedSource

log = logging.getLogger("worker.runner")


def run_job(
    sessions: SessionFactory,
    job_id: str,
    cfg: RunnerConfig,
    worker_id: str | None = None,
    dispatch: Dispatch | None = None,
) -> Outcome:
    """One attempt at the job. Idempotent: a job that is not queued is left alone.

    With `dispatch` (the Celery chord of worker.tasks), a job whose source is sharded is
    fanned out (worker.fanout): its parts are recorded and dispatched, and this returns
    Outcome("fanned_out") while the parts run on any worker.

    Every database write is retried through an outage (cfg.db_retry_s); only an outage longer
    than that abandons the attempt (the job is left running without heartbeats, and the sweep
    re-queues it)."""
    worker_id = worker_id or default_worker_id()
    try:
        claimed = claim_job(sessions, job_id, worker_id, cfg.db_retry_s)
    except DatabaseUnavailableError as exc:
        log.error("job %s: not claimed: %s (the sweep sends it again)", job_id, exc)
        return Outcome("lost", str(exc))
    if claimed is None:
        log.info("job %s: nothing to claim (duplicate delivery, finished or cancelled)", job_id)
        return Outcome("skipped")
    attempt = claimed.attempt
    log.info("job %s: claimed by %s (attempt %d) on %s", job_id, worker_id, attempt, cfg.device)
    writer = ProgressWriter(
        sessions,
        job_id,
        worker_id,
        min_interval=cfg.progress_min_interval_s,
        layer_delay=cfg.debug_layer_delay_s,
        db_retry_s=cfg.db_retry_s,
    )
    clear_stale_staging(cfg.artifacts_dir, job_id)
    staging = staging_dir(cfg.artifacts_dir, job_id, attempt)
    if cfg.disk_quota_bytes_per_key > 0:
        writer.guard = DiskGuard(sessions, job_id, staging, cfg.disk_quota_bytes_per_key)
    try:
        # Before hours of work: the store must be there, and what earlier attempts of this
        # job left in it goes (a local folder: nothing to do before the attempt).
        cfg.store.prepare_job(job_id)
        with heartbeating(writer, cfg.heartbeat_interval_s):
            final = _run_attempt(
                Attempt(sessions, job_id, worker_id, cfg, writer, staging, claimed, dispatch)
            )
        if final is None:
            return Outcome("fanned_out")
        storage_recovered()
        return Outcome("succeeded")
    except DatabaseUnavailableError as exc:
        # Longer than cfg.db_retry_s: nothing can be recorded. The heartbeat stops, so the
        # sweep re-queues the job (bounded attempts).
        log.error("job %s: attempt abandoned: %s", job_id, exc)
        return Outcome("lost", str(exc))
    except (CancelledError, state.JobCancelRequestedError) as exc:
        return stop_job(sessions, job_id, worker_id, str(exc), cfg.db_retry_s)
    except state.IllegalTransitionError as exc:
        log.warning("job %s: lost ownership (%s)", job_id, exc)
        return Outcome("lost", str(exc))
    except Exception as exc:
        # (KeyboardInterrupt / SystemExit are not failures of the job: they propagate and the
        # job, left running without heartbeats, is re-queued by the sweep.)
        if isinstance(exc, DBAPIError) and is_transient(exc):
            log.error("job %s: attempt abandoned: the database is unreachable (%s)", job_id, exc)
            return Outcome("lost", str(exc))
        if isinstance(exc, StoreUnavailableError):
            remove_tree(staging)
            return wait_for_store(sessions, job_id, worker_id, cfg, exc)
        if is_storage_full(exc):
            remove_tree(staging)
            return wait_for_storage(sessions, job_id, worker_id, cfg, exc)
        reclaimed = reclaim_failed(staging, writer.guard)
        outcome = fail_job(sessions, job_id, worker_id, cfg, exc)
        note_reclaimed(sessions, job_id, reclaimed, cfg.db_retry_s)
        return outcome
    finally:
        remove_tree(staging)
        remove_empty_job_dir(cfg.artifacts_dir, job_id)


def _run_attempt(attempt: Attempt) -> Path | None:
    """Resolve, then fan out (a sharded source, with a dispatcher), or run the job here.
    Returns the published directory, or None when the job was fanned out."""
    writer, claimed = attempt.writer, attempt.claimed
    if writer("resolving", 0, 1) is False:
        raise CancelledError("cancelled before the model was resolved")
    job_cfg = JobConfig.load(claimed.config)
    # Dynamic targets fan out after the profile and the allocation (one worker, here).
    may_fan_out = (
        attempt.dispatch is not None
        and not job_cfg.calibration
        and not job_cfg.evaluate
        and not job_cfg.gguf
        and not job_cfg.ct
    )
    if job_cfg.gguf:
        found = locate(_request(attempt))
        _record_revision(attempt, found.revision)
        _check_evaluate(attempt.cfg, job_cfg)
        return _run_gguf(attempt, job_cfg, found)
    model = _resolve(attempt, job_cfg, may_fan_out)
    if writer("resolving", 1, 1) is False:
        raise CancelledError("cancelled after the model was resolved")
    if may_fan_out and attempt.dispatch is not None and model.sharded:
        from higgs_engine.job import plan
        from worker.fanout import start_fanout

        # Planned once, here (a dynamic target's profile and allocation too); every part
        # and the assembly run this plan.
        start_fanout(attempt, plan(_engine_job(attempt, job_cfg, model), writer, model))
        return None
    return _run_here(attempt, job_cfg, model)


def _request(attempt: Attempt) -> ModelRequest:
    cfg, claimed = attempt.cfg, attempt.claimed
    requested = (claimed.request.get("model") or {}).get("revision")
    return ModelRequest(
        claimed.model_id,
        claimed.pinned or requested,
        cfg.models_dir,
        job_hub_token(attempt.sessions, attempt.job_id, cfg.hub_tokens),
        cfg.hf_offline,
    )


def _resolve(attempt: Attempt, job_cfg: JobConfig, may_fan_out: bool) -> ResolvedModel:
    """The job's model resolved once for the attempt, its commit sha recorded on the job. A
    Hub model that may fan out: its shard index first, each part fetches its shards (a
    dynamic target's profile needs every shard here); not sharded after all, every file."""
    from worker.fanout import is_sharded

    request = _request(attempt)
    index_only = may_fan_out and not job_cfg.is_dynamic
    found = locate(request, () if index_only else None)
    if index_only and found.kind == "hub" and not is_sharded(found.path):
        found = locate(replace(request, revision=found.revision), None)
    _record_revision(attempt, found.revision)
    return describe_located(found)


def _record_revision(attempt: Attempt, revision: str | None) -> None:
    """The commit sha read, recorded on the job once (a retry reads the same files)."""
    if not revision or revision == attempt.claimed.pinned:
        return
    sessions, job_id, worker_id = attempt.sessions, attempt.job_id, attempt.worker_id

    def record() -> None:
        with sessions() as s:
            state.record_model_revision(s, job_id, revision, worker_id=worker_id)

    retry_db(record, f"model revision of job {job_id}", attempt.cfg.db_retry_s)


def _engine_job(
    attempt: Attempt,
    job_cfg: JobConfig,
    model: ResolvedModel,
    annotate: Annotate | None = None,
    on_plan: Callable[[JobPlan], None] | None = None,
) -> QuantizeJob:
    """The engine's QuantizeJob of the claimed job (calibration aside) on `model`."""
    from higgs_engine.job import CtOptions, ProfileSource, QuantizeJob
    from higgs_engine.planning.config import HiggsConfig
    from higgs_engine.planning.plans import Target

    cfg, claimed = attempt.cfg, attempt.claimed
    dynamic = job_cfg.is_dynamic
    requested = (claimed.request.get("model") or {}).get("revision")
    profile = ProfileSource()
    if dynamic:
        menu_p = None if job_cfg.ct else job_menu_p(job_cfg, claimed.request)
        ps = cfg.profile_settings()
        profile = job_profile_source(attempt.sessions, model, requested, menu_p, ps)
    config, ct = job_cfg.higgs_config(), None
    if job_cfg.ct:  # vLLM's schemes per layer; of the HIGGS config only the dtype
        ct = CtOptions(bits=None if dynamic else int(job_cfg.target_value), dtype=config.dtype)
        config = HiggsConfig()
    return QuantizeJob(
        model,
        config,
        target=Target(**dict(job_cfg.target)) if dynamic else None,
        profile=profile,
        device=cfg.device,
        annotate=annotate,
        on_plan=on_plan,
        ct=ct,
    )


def _run_here(attempt: Attempt, job_cfg: JobConfig, model: ResolvedModel) -> Path:
    """The whole job on this worker: the engine's run, the optional evaluation, publishing."""
    from dataclasses import replace as with_

    from higgs_engine.job import run

    sessions, cfg, writer = attempt.sessions, attempt.cfg, attempt.writer
    evaluate = job_cfg.evaluate
    engine_cfg = job_cfg.higgs_config()
    formats = [CT_FORMAT] if job_cfg.ct else list(engine_cfg.formats)
    # what options.evaluate measures: the native artifact, or the compressed-tensors
    # checkpoint as transformers loads it
    measured = CT_FORMAT if job_cfg.ct else "native"
    _check_evaluate(cfg, job_cfg)
    if evaluate and measured not in formats:
        raise InvalidConfigError("options.evaluate=true needs the native format in options.formats")
    # Calibrated HIGGS: the uploaded text, checked here and tokenized with the model's
    # tokenizer before any quantization (a text with too few tokens fails the job, nothing
    # written).
    calibration = load_job_calibration(sessions, job_cfg.calibration, cfg.db_retry_s)
    attempt.staging.mkdir(parents=True, exist_ok=True)
    out = attempt.staging / "out"
    t0 = time.perf_counter()
    planned: list[JobPlan] = []

    def annotate(report: Report, staged: Path) -> None:
        record_service(report, attempt.worker_id, t0)
        if planned and job_cfg.is_dynamic:
            report.metrics.setdefault("service", {})["profile"] = profile_entry(planned[0], model)
        elif cfg.profiles is not None:
            annotate_uniform(sessions, model, cfg.profiles, report)
        if evaluate:
            t1 = time.perf_counter()
            es = EvalSettings(cfg.eval_text_file, cfg.eval_context, cfg.eval_windows)
            report.metrics.update(evaluate_artifact(model.path, staged / measured, es, writer))
            report.timings["evaluating"] = time.perf_counter() - t1

    job = _engine_job(attempt, job_cfg, model, annotate, planned.append)
    report = run(with_(job, calibration=calibration), out, writer)
    engine_s = float(report.metrics["service"]["engine_wall_s"])
    final = publish_result(attempt, out, report, formats, model.revision)
    log.info("job %s: succeeded in %.2f s (engine)", attempt.job_id, engine_s)
    return final


def _check_evaluate(cfg: RunnerConfig, job_cfg: JobConfig) -> None:
    """options.evaluate needs the worker's evaluation text: said before the long part."""
    if job_cfg.evaluate and cfg.eval_text_file is None:
        raise InvalidConfigError(
            f"options.evaluate=true needs an evaluation text on the worker; set {EVAL_TEXT_ENV}"
        )


def record_service(report: Report, worker_id: str, t0: float) -> None:
    """The service's part of a job's report: the worker and the engine's wall time since `t0`
    (evaluation aside). The report's source is the model as the worker resolved it."""
    report.metrics.setdefault("service", {}).update(
        {"worker_id": worker_id, "engine_wall_s": round(time.perf_counter() - t0, 4)}
    )


def _run_gguf(attempt: Attempt, job_cfg: JobConfig, source: ResolvedSource) -> Path | None:
    """A GGUF job: llama.cpp's types per tensor for the target (worker.gguf)."""
    from worker.gguf import GgufJob, GgufWorker, quantize_gguf_job

    if attempt.writer("resolving", 1, 1) is False:
        raise CancelledError("cancelled after the model was resolved")
    cfg = attempt.cfg
    requested = (attempt.claimed.request.get("model") or {}).get("revision")
    attempt.staging.mkdir(parents=True, exist_ok=True)
    out = attempt.staging / "out"
    t0 = time.perf_counter()

    def annotate(report: Report, _staged: Path) -> None:
        # The GGUF run resolves the directory itself: the job's identity goes in here.
        report.source.update({"id": source.id, "revision": source.revision, "kind": source.kind})
        record_service(report, attempt.worker_id, t0)

    gguf = GgufJob(source, requested, dict(job_cfg.target), job_cfg.gguf_rotate, job_cfg.evaluate)
    report = quantize_gguf_job(
        attempt.sessions, gguf, GgufWorker.of(cfg), out, attempt.writer, annotate
    )
    engine_s = float(report.metrics["service"]["engine_wall_s"])
    final = publish_result(attempt, out, report, ["gguf"], source.revision)
    log.info("job %s: succeeded in %.2f s (engine, gguf)", attempt.job_id, engine_s)
    return final
