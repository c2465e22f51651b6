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
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.exc import DBAPIError

from app.artifacts.store import StoreUnavailableError
from app.jobs import state
from app.jobs.job_config import JobConfig
from higgs_engine.errors import CancelledError, InvalidConfigError
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
from worker.dynamic import (
    annotate_uniform,
    job_menu_p,
    job_profile_source,
    plan_dynamic_job,
    profile_entry,
)
from worker.evaluation import EVAL_TEXT_ENV, EvalSettings, evaluate_artifact
from worker.messages import is_storage_full
from worker.models import ModelSource, job_hub_token, resolve_model
from worker.progress import ProgressWriter, heartbeating
from worker.publish import publish_result, remove_empty_job_dir
from worker.scratch import DiskGuard, note_reclaimed, reclaim_failed
from worker.staging import clear_stale_staging, remove_tree, staging_dir
from worker.storage import storage_recovered, wait_for_storage, wait_for_store

if TYPE_CHECKING:
    from higgs_engine.dynamic import DynamicPlan
    from higgs_engine.report import Report

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
    sessions, job_id, worker_id = attempt.sessions, attempt.job_id, attempt.worker_id
    cfg, writer, staging = attempt.cfg, attempt.writer, attempt.staging
    model_id, request, pinned = (
        attempt.claimed.model_id,
        attempt.claimed.request,
        attempt.claimed.pinned,
    )
    from higgs_engine.job import ProfileSource, QuantizeJob, run
    from higgs_engine.planning.plans import Target

    if writer("resolving", 0, 1) is False:
        raise CancelledError("cancelled before the model was resolved")
    hub_token = job_hub_token(sessions, job_id, cfg.hub_tokens)
    requested = (request.get("model") or {}).get("revision")
    job_cfg = JobConfig.load(attempt.claimed.config)
    # Dynamic targets fan out after the profile and the allocation (one worker, here).
    may_fan_out = (
        attempt.dispatch is not None
        and not job_cfg.calibration
        and not job_cfg.evaluate
        and not job_cfg.gguf
    )
    source = resolve_model(
        model_id,
        pinned or requested,
        models_dir=cfg.models_dir,
        token=hub_token,
        offline=cfg.hf_offline,
        # A Hub model that may fan out: its shard index first, each part fetches its shards
        # (a dynamic target's profile needs every shard here).
        shards=() if may_fan_out and not job_cfg.is_dynamic else None,
    )
    if source.revision and source.revision != pinned:
        revision = source.revision

        def record_revision() -> None:
            with sessions() as s:
                state.record_model_revision(s, job_id, revision, worker_id=worker_id)

        retry_db(record_revision, f"model revision of job {job_id}", cfg.db_retry_s)
    if writer("resolving", 1, 1) is False:
        raise CancelledError("cancelled after the model was resolved")
    engine_cfg = job_cfg.higgs_config()
    if may_fan_out and attempt.dispatch is not None:
        from worker.fanout import is_sharded, start_fanout

        if is_sharded(source.path):
            fan_cfg = engine_cfg
            if job_cfg.is_dynamic:
                # Profile + allocation once, here; every part quantizes with the plan's
                # per-layer grids (its config's overrides).
                fan_cfg = plan_dynamic_job(
                    sessions,
                    source,
                    requested,
                    engine_cfg,
                    dict(job_cfg.target),
                    job_menu_p(job_cfg, request),
                    cfg.profile_settings(),
                    writer,
                    cfg.device,
                ).config
            start_fanout(attempt, source, fan_cfg, attempt.dispatch)
            return None
        if source.kind == "hub" and not job_cfg.is_dynamic:  # not sharded: every file
            source = resolve_model(
                model_id,
                source.revision,
                models_dir=cfg.models_dir,
                token=hub_token,
                offline=cfg.hf_offline,
            )
    evaluate = job_cfg.evaluate
    if evaluate and cfg.eval_text_file is None:
        # Before the long part: say it now rather than after quantizing.
        raise InvalidConfigError(
            f"options.evaluate=true needs an evaluation text on the worker; set {EVAL_TEXT_ENV}"
        )
    if job_cfg.gguf:
        return _run_gguf(attempt, job_cfg, source, requested)
    if evaluate and "native" not in engine_cfg.formats:
        raise InvalidConfigError("options.evaluate=true needs the native format in options.formats")
    # Calibrated HIGGS: the uploaded text, tokenized with the model's tokenizer, before any
    # quantization (a text with too few tokens fails the job here, nothing written).
    calibration = load_job_calibration(sessions, job_cfg.calibration, source.path, cfg.db_retry_s)
    staging.mkdir(parents=True, exist_ok=True)
    out = staging / "out"
    t0 = time.perf_counter()

    planned: list[DynamicPlan] = []

    def annotate(report: Report, staged: Path) -> None:
        record_service(report, source, worker_id, t0)
        if planned:
            report.metrics.setdefault("service", {})["profile"] = profile_entry(planned[0], source)
        elif cfg.profiles is not None:
            annotate_uniform(sessions, source, cfg.profiles, report)
        if evaluate:
            t1 = time.perf_counter()
            es = EvalSettings(cfg.eval_text_file, cfg.eval_context, cfg.eval_windows)
            report.metrics.update(evaluate_artifact(source.path, staged / "native", es, writer))
            report.timings["evaluating"] = time.perf_counter() - t1

    dynamic = job_cfg.is_dynamic
    job = QuantizeJob(
        source.path,
        engine_cfg,
        target=Target(**dict(job_cfg.target)) if dynamic else None,
        calibration=calibration,
        profile=(
            job_profile_source(
                sessions, source, requested, job_menu_p(job_cfg, request), cfg.profile_settings()
            )
            if dynamic
            else ProfileSource()
        ),
        device=cfg.device,
        annotate=annotate,
        on_plan=planned.append,
    )
    report = run(job, out, writer)
    engine_s = float(report.metrics["service"]["engine_wall_s"])
    final = publish_result(attempt, out, report, list(engine_cfg.formats), source.revision)
    log.info("job %s: succeeded in %.2f s (engine)", job_id, engine_s)
    return final


def record_service(report: Report, source: ModelSource, worker_id: str, t0: float) -> None:
    """The service's part of a job's report: the model as the worker resolved it (id,
    revision, kind), the worker, and the engine's wall time since `t0` (evaluation aside)."""
    report.source.update({"id": source.id, "revision": source.revision, "kind": source.kind})
    report.metrics.setdefault("service", {}).update(
        {"worker_id": worker_id, "engine_wall_s": round(time.perf_counter() - t0, 4)}
    )


def _run_gguf(
    attempt: Attempt, job_cfg: JobConfig, source: ModelSource, requested: str | None
) -> Path | None:
    """A GGUF job: llama.cpp's types per tensor for the target (worker.gguf)."""
    from worker.gguf import GgufJob, GgufWorker, quantize_gguf_job

    cfg = attempt.cfg
    attempt.staging.mkdir(parents=True, exist_ok=True)
    out = attempt.staging / "out"
    t0 = time.perf_counter()

    def annotate(report: Report, _staged: Path) -> None:
        record_service(report, source, attempt.worker_id, t0)

    gguf = GgufJob(source, requested, dict(job_cfg.target), job_cfg.gguf_rotate, job_cfg.evaluate)
    report = quantize_gguf_job(
        attempt.sessions, gguf, GgufWorker.of(cfg), out, attempt.writer, annotate
    )
    engine_s = float(report.metrics["service"]["engine_wall_s"])
    final = publish_result(attempt, out, report, ["gguf"], source.revision)
    log.info("job %s: succeeded in %.2f s (engine, gguf)", attempt.job_id, engine_s)
    return final
