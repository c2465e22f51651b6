"""The runner: everything one job attempt does, from claim to published artifacts.

    claim (compare-and-set queued -> running)
      -> resolve the model (local name under models_dir, or Hub id pinned to a commit sha)
      -> higgs_engine.pipeline.quantize_checkpoint, with a progress callback that writes
         stage / progress / heartbeat and asks the engine to stop when cancel was requested
      -> publish the artifacts atomically (rename) with a sha256 per file
      -> app.jobs.state.succeed (report, layers, artifact rows in one transaction)

Failures become a job error code (HiggsError.code for the engine's typed errors). A cancelled,
failed or lost attempt leaves nothing under the published artifact directory.

Directory layout under artifacts_dir:
    .staging/<job_id>.<attempt>.<hex>/   the engine writes here (never served)
    <job_id>/<attempt>.<hex>/<format>/   published attempt, referenced by the artifact rows
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.manifest import artifact_rows as manifest_rows
from app.artifacts.store import (
    ArtifactStore,
    StoreUnavailableError,
    UploadFile,
    join_uri,
    store_from_settings,
)
from app.db.models import CANCELLED, FAILED, RUNNING, SUCCEEDED, Job
from app.jobs import state
from app.jobs.job_config import JobConfig
from app.jobs.rows import ArtifactRow
from app.settings import Settings
from higgs_engine.errors import CancelledError, HiggsError, InvalidConfigError
from worker.dbretry import DatabaseUnavailableError, is_transient, retry_db
from worker.dynamic import (
    ProfileSettings,
    annotate_uniform,
    plan_dynamic_job,
    quantize_dynamic,
)
from worker.evaluation import EVAL_TEXT_ENV, EvalSettings, evaluate_artifact
from worker.messages import is_storage_full, message_roots, public_message, storage_error_text

log = logging.getLogger("worker.runner")

STAGING = ".staging"
# Engine error codes that are also job error codes, as they are (docs/api.md, job "error").
ENGINE_CODES = frozenset(
    {
        "invalid_config",
        "model_not_found",
        "unsupported_model",
        "corrupt_checkpoint",
        "infeasible_target",
        "profile_not_found",
    }
)
# Test-only knob: seconds to sleep after each quantized layer, so that tests can kill or
# cancel a job in the middle. Never set it in production.
DEBUG_LAYER_DELAY_ENV = "HIGGS_DEBUG_LAYER_DELAY_S"

SessionFactory = sessionmaker[Session]


@dataclass(frozen=True)
class RunnerConfig:
    """What the runner needs from the settings (read once per worker process)."""

    artifacts_dir: Path
    models_dir: Path | None
    hf_token: str | None
    hf_offline: bool
    device: str
    heartbeat_interval_s: float
    progress_min_interval_s: float = 0.5
    debug_layer_delay_s: float = 0.0
    # Evaluation text for jobs with options.evaluate (settings.eval_text_file); None = refuse them.
    eval_text_file: Path | None = None
    eval_context: int = 512
    eval_windows: int = 16
    # Dynamic HIGGS (avg_bits / max_ppl_increase targets): how profiles are measured and cached.
    profiles: ProfileSettings | None = None
    # How long a database write is retried through an outage before the attempt is abandoned.
    db_retry_s: float = 300.0
    # An artifact store other than artifacts_dir (HIGGS_ARTIFACTS_URL=s3://...): the engine
    # still writes to local staging, then the files are uploaded there. None: artifacts_dir.
    store: ArtifactStore | None = None

    @classmethod
    def from_settings(cls, settings: Settings, device: str) -> RunnerConfig:
        delay = float(os.environ.get(DEBUG_LAYER_DELAY_ENV, "0") or 0)
        return cls(
            artifacts_dir=settings.artifacts_path,
            models_dir=settings.models_dir,
            hf_token=settings.hf_token,
            hf_offline=settings.hf_offline,
            device=device,
            # Several beats per timeout, so one slow write never makes a live job look dead.
            heartbeat_interval_s=max(0.2, min(15.0, settings.heartbeat_timeout_s / 4)),
            debug_layer_delay_s=max(0.0, delay),
            eval_text_file=settings.eval_text_file,
            eval_context=settings.eval_context,
            eval_windows=settings.eval_windows,
            profiles=ProfileSettings.from_settings(settings),
            db_retry_s=settings.worker_db_retry_s,
            store=store_from_settings(settings) if settings.artifacts_url else None,
        )


def job_error_code(exc: BaseException) -> str:
    """The job's error code for an exception escaping the engine."""
    if isinstance(exc, HiggsError):
        return exc.code if exc.code in ENGINE_CODES else "engine_error"
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return "out_of_memory"
    if type(exc).__name__ in ("SoftTimeLimitExceeded", "TimeLimitExceeded"):
        return "time_limit"
    return "internal_error"


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# ---------------------------------------------------------------- progress + heartbeat


class ProgressWriter:
    """The engine's progress callback: writes stage/done/total (and so the heartbeat) to the
    job row, at most every `min_interval` seconds within a stage, and returns False once the
    job should stop (cancel requested, or this worker no longer owns the job)."""

    def __init__(
        self,
        sessions: SessionFactory,
        job_id: str,
        worker_id: str,
        *,
        min_interval: float = 0.5,
        layer_delay: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        db_retry_s: float = 300.0,
    ) -> None:
        self.sessions = sessions
        self.db_retry_s = db_retry_s
        self.job_id = job_id
        self.worker_id = worker_id
        self.min_interval = min_interval
        self.layer_delay = layer_delay
        self.clock = clock
        self.sleep = sleep
        self.stop = threading.Event()
        self.last: tuple[str, int, int] = ("", 0, 0)
        self._last_write = -1e18
        self._lock = threading.Lock()

    def write(self, stage: str, done: int, total: int) -> bool:
        def once() -> bool:
            with self.sessions() as s:
                return state.record_progress(
                    s, self.job_id, stage, done, total, worker_id=self.worker_id
                )

        # Through a database outage the engine waits here (retrying), then goes on.
        with self._lock:
            go = retry_db(once, f"progress of job {self.job_id}", self.db_retry_s)
        self._last_write = self.clock()
        if not go:
            self.stop.set()
        return go

    def __call__(self, stage: str, done: int, total: int) -> bool:
        if self.stop.is_set():
            return False
        changed = stage != self.last[0]
        self.last = (stage, done, total)
        due = self.clock() - self._last_write >= self.min_interval
        if (changed or due or done >= total) and not self.write(stage, done, total):
            return False
        if self.layer_delay and stage in ("quantizing", "profiling") and done > 0:
            self.sleep(self.layer_delay)
        return not self.stop.is_set()

    def beat(self) -> None:
        """A heartbeat between progress calls (long loads, long layers)."""

        def once() -> bool:
            with self.sessions() as s:
                return state.heartbeat(s, self.job_id, worker_id=self.worker_id)

        with self._lock:
            go = retry_db(once, f"heartbeat of job {self.job_id}", self.db_retry_s)
        if not go:
            self.stop.set()


@contextlib.contextmanager
def heartbeating(writer: ProgressWriter, interval: float) -> Iterator[None]:
    """Run writer.beat() every `interval` seconds in a daemon thread while the block runs."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(interval):
            try:
                writer.beat()
            except Exception as e:  # a missed beat is not fatal; the next one may work
                log.warning("heartbeat for job %s failed: %s", writer.job_id, e)

    t = threading.Thread(target=loop, name=f"heartbeat-{writer.job_id}", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join(timeout=5)


# ---------------------------------------------------------------- artifacts


def staging_dir(artifacts_dir: Path, job_id: str, attempt: int) -> Path:
    return artifacts_dir / STAGING / f"{job_id}.{attempt}.{uuid.uuid4().hex[:8]}"


def remove_tree(path: Path) -> None:
    """Remove a directory: first renamed out of the way (atomic), then deleted."""
    if not path.exists():
        return
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        path.rename(trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def clear_stale_staging(artifacts_dir: Path, job_id: str) -> None:
    """Leftovers of earlier attempts of this job (a killed worker cannot clean up after itself)."""
    root = artifacts_dir / STAGING
    if root.is_dir():
        for p in root.glob(f"{job_id}.*"):
            remove_tree(p)


def publish(out_dir: Path, artifacts_dir: Path, job_id: str, attempt_name: str) -> Path:
    """Move a finished engine output into artifacts_dir/<job_id>/<attempt_name> in one rename."""
    job_dir = artifacts_dir / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    final = job_dir / attempt_name
    os.rename(out_dir, final)  # same filesystem: atomic
    return final


def prune_job_dir(artifacts_dir: Path, job_id: str, keep: Path | None) -> None:
    """Remove every published attempt of the job except `keep` (and the job dir if empty)."""
    job_dir = artifacts_dir / job_id
    if not job_dir.is_dir():
        return
    for p in job_dir.iterdir():
        if keep is None or p.resolve() != keep.resolve():
            remove_tree(p) if p.is_dir() else p.unlink(missing_ok=True)
    if keep is None:
        with contextlib.suppress(OSError):
            job_dir.rmdir()


def remove_empty_job_dir(artifacts_dir: Path, job_id: str) -> None:
    with contextlib.suppress(OSError):
        (artifacts_dir / job_id).rmdir()


def artifact_rows(final: Path, formats: list[str]) -> list[ArtifactRow]:
    rows = manifest_rows({fmt: final / fmt for fmt in formats if (final / fmt).is_dir()})
    if not rows:
        raise HiggsError(f"the engine wrote none of the requested formats {formats}")
    return rows


# ---------------------------------------------------------------- the job


@dataclass
class Outcome:
    status: str  # "skipped", "succeeded", "failed", "cancelled", "lost", "storage_full"
    detail: str = ""


def _job_snapshot(sessions: SessionFactory, job_id: str, budget_s: float = 300.0) -> Job | None:
    def once() -> Job | None:
        with sessions() as s:
            job = s.get(Job, job_id, populate_existing=True)
            if job is not None:
                s.expunge(job)
            return job

    return retry_db(once, f"state of job {job_id}", budget_s)


def _ours_now(
    sessions: SessionFactory, job_id: str, worker_id: str, status: str, budget_s: float
) -> bool:
    """After a write whose commit may have landed before its connection broke: is the job
    already in `status`, owned by this worker (then the write did happen)?"""
    job = _job_snapshot(sessions, job_id, budget_s)
    return job is not None and job.status == status and job.worker_id == worker_id


@dataclass(frozen=True)
class _Claimed:
    model_id: str
    request: dict[str, Any]
    config: dict[str, Any]
    pinned: str | None
    attempt: int


def _claim(
    sessions: SessionFactory, job_id: str, worker_id: str, budget_s: float
) -> _Claimed | None:
    tries = 0

    def once() -> _Claimed | None:
        nonlocal tries
        tries += 1
        with sessions() as s:
            job = state.claim(s, job_id, worker_id)
            if job is None and tries > 1:
                # An earlier try may have committed the claim and lost the reply.
                row = s.get(Job, job_id, populate_existing=True)
                if row is not None and row.status == RUNNING and row.worker_id == worker_id:
                    job = row
            if job is None:
                return None
            return _Claimed(
                job.model_id, dict(job.request), dict(job.config), job.model_revision, job.attempts
            )

    return retry_db(once, f"claim of job {job_id}", budget_s)


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
        claimed = _claim(sessions, job_id, worker_id, cfg.db_retry_s)
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
    try:
        if cfg.store is not None:
            # Before hours of work: the store must be there. What earlier attempts of this
            # job left in it (objects, open multipart uploads) goes: none of it is published.
            cfg.store.check()
            cfg.store.clear_job(job_id, keep=None)
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
        return _stop(sessions, job_id, worker_id, str(exc), cfg.db_retry_s)
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
            return _wait_for_store(sessions, job_id, worker_id, cfg, exc)
        if is_storage_full(exc):
            remove_tree(staging)
            return _wait_for_storage(sessions, job_id, worker_id, cfg, exc)
        return _fail(sessions, job_id, worker_id, cfg, exc)
    finally:
        remove_tree(staging)
        remove_empty_job_dir(cfg.artifacts_dir, job_id)


def _fail(
    sessions: SessionFactory, job_id: str, worker_id: str, cfg: RunnerConfig, exc: Exception
) -> Outcome:
    code = job_error_code(exc)
    message = public_message(exc, message_roots(cfg))
    if code in ("internal_error", "engine_error"):
        log.exception("job %s failed", job_id)
    else:
        log.warning("job %s failed: %s: %s", job_id, code, message)
    tries = 0

    def once() -> None:
        nonlocal tries
        tries += 1
        try:
            with sessions() as s:
                state.fail(s, job_id, code, message or code, worker_id=worker_id)
        except state.IllegalTransitionError:
            if tries > 1 and _ours_now(sessions, job_id, worker_id, FAILED, cfg.db_retry_s):
                return
            raise

    try:
        retry_db(once, f"failure of job {job_id}", cfg.db_retry_s)
    except state.IllegalTransitionError as e:
        log.warning("job %s: could not record the failure (%s)", job_id, e)
        return Outcome("lost", str(e))
    except DatabaseUnavailableError as e:
        log.error("job %s: could not record the failure: %s", job_id, e)
        return Outcome("lost", str(e))
    return Outcome("failed", f"{code}: {message}")


# ---------------------------------------------------------------- a full disk

# Set while this process has seen the artifacts volume full and no job has succeeded since:
# the operator is told once, not once per job.
_storage_full_since: float | None = None


def storage_recovered() -> None:
    global _storage_full_since
    if _storage_full_since is not None:
        log.info("the artifacts volume has room again (a job was published)")
        _storage_full_since = None


def free_bytes(path: Path) -> int | None:
    """Free bytes on the volume holding `path` (its nearest existing parent); None if unknown."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _wait_for_storage(
    sessions: SessionFactory, job_id: str, worker_id: str, cfg: RunnerConfig, exc: BaseException
) -> Outcome:
    """The volume is full: the job goes back to the queue (its attempt not counted) with error
    storage_full; the sweep sends it again once the artifacts volume has more room."""
    global _storage_full_since
    free = free_bytes(cfg.artifacts_dir)
    shown = "unknown" if free is None else f"{free / 2**20:.1f} MiB"
    message = (
        "the server's storage is full (no space left on device); the job waits in the queue "
        "and runs again once space is freed"
    )
    if _storage_full_since is None:
        _storage_full_since = time.monotonic()
        log.error(
            "storage full: %s (%s free on the artifacts volume %s after cleanup); job %s and any "
            "other job that needs space wait in the queue until space is freed",
            storage_error_text(exc),
            shown,
            cfg.artifacts_dir,
            job_id,
        )
    else:
        log.info("job %s: storage still full; back in the queue", job_id)

    def once() -> bool:
        with sessions() as s:
            return state.wait_for_storage(s, job_id, message, free, worker_id=worker_id)

    try:
        requeued = retry_db(once, f"storage wait of job {job_id}", cfg.db_retry_s)
    except DatabaseUnavailableError as e:
        log.error("job %s: could not record the storage wait: %s", job_id, e)
        return Outcome("lost", str(e))
    if not requeued:  # cancel requested meanwhile, or the job is no longer ours
        return _stop(sessions, job_id, worker_id, "storage full", cfg.db_retry_s)
    return Outcome("storage_full", message)


def _wait_for_store(
    sessions: SessionFactory, job_id: str, worker_id: str, cfg: RunnerConfig, exc: BaseException
) -> Outcome:
    """The artifact store cannot be used: the job goes back to the queue (its attempt not
    counted) with error storage_unavailable; the sweep sends it again once the store answers."""
    where = cfg.store.describe() if cfg.store is not None else str(cfg.artifacts_dir)
    log.error("job %s: artifact store %s unavailable (%s); back in the queue", job_id, where, exc)
    message = (
        "the artifact store cannot be reached; the job waits in the queue and runs again once "
        "it can"
    )

    def once() -> bool:
        with sessions() as s:
            return state.wait_for_storage(
                s, job_id, message, None, worker_id=worker_id, code=state.STORAGE_UNAVAILABLE
            )

    try:
        requeued = retry_db(once, f"store wait of job {job_id}", cfg.db_retry_s)
    except DatabaseUnavailableError as e:
        log.error("job %s: could not record the store wait: %s", job_id, e)
        return Outcome("lost", str(e))
    if not requeued:
        return _stop(sessions, job_id, worker_id, "artifact store unavailable", cfg.db_retry_s)
    return Outcome(state.STORAGE_UNAVAILABLE, message)


def _upload(
    store: ArtifactStore,
    out: Path,
    job_id: str,
    attempt_name: str,
    formats: list[str],
    writer: ProgressWriter,
) -> tuple[str, list[ArtifactRow]]:
    """Hash the engine's output (sha256 per file, computed here: S3 has no whole-object
    SHA-256 for multipart uploads) and upload it under the attempt's URI, which no artifact
    row names yet. Returns (attempt URI, artifact rows naming it)."""
    rows = artifact_rows(out, formats)
    uri = store.attempt_uri(job_id, attempt_name)
    files = [
        UploadFile(f"{row.format}/{f.path}", out / row.format / f.path, f.sha256)
        for row in rows
        for f in row.files
    ]
    done = 0

    def should_stop() -> bool:
        nonlocal done
        go = writer("uploading", done, len(files))
        done += 1
        return not go

    if not store.upload(uri, files, should_stop):
        raise CancelledError("cancelled while uploading the artifacts")
    writer("uploading", len(files), len(files))
    return uri, [dataclasses.replace(row, uri=join_uri(uri, row.format)) for row in rows]


@dataclass(frozen=True)
class Attempt:
    """One attempt at a job: where it records (sessions, job, worker), how it runs (the
    runner's config), where it reports progress and writes files, and what was claimed."""

    sessions: SessionFactory
    job_id: str
    worker_id: str
    cfg: RunnerConfig
    writer: ProgressWriter
    staging: Path
    claimed: _Claimed
    dispatch: Dispatch | None = None


# dispatch(job_id, job attempt, part indexes): send the parts and their assembly (a chord).
Dispatch = Callable[[str, int, list[int]], bool]


def _run_attempt(attempt: Attempt) -> Path | None:
    sessions, job_id, worker_id = attempt.sessions, attempt.job_id, attempt.worker_id
    cfg, writer, staging = attempt.cfg, attempt.writer, attempt.staging
    model_id, request, pinned = (
        attempt.claimed.model_id,
        attempt.claimed.request,
        attempt.claimed.pinned,
    )
    from higgs_engine.pipeline import quantize_checkpoint
    from worker.models import resolve_model

    if writer("resolving", 0, 1) is False:
        raise CancelledError("cancelled before the model was resolved")
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
        token=cfg.hf_token,
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
                    _profiles(cfg),
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
                token=cfg.hf_token,
                offline=cfg.hf_offline,
            )
    evaluate = job_cfg.evaluate
    if job_cfg.gguf:
        return _run_gguf(attempt, job_cfg, source, requested)
    if evaluate and "native" not in engine_cfg.formats:
        raise InvalidConfigError("options.evaluate=true needs the native format in options.formats")
    if evaluate and cfg.eval_text_file is None:
        # Before the long part: say it now rather than after quantizing.
        raise InvalidConfigError(
            f"options.evaluate=true needs an evaluation text on the worker; set {EVAL_TEXT_ENV}"
        )
    # Calibrated HIGGS: the uploaded text, tokenized with the model's tokenizer, before any
    # quantization (a text with too few tokens fails the job here, nothing written).
    calibration = load_job_calibration(sessions, job_cfg.calibration, source.path, cfg.db_retry_s)
    staging.mkdir(parents=True, exist_ok=True)
    out = staging / "out"
    t0 = time.perf_counter()

    if job_cfg.is_dynamic:
        report = quantize_dynamic(
            sessions,
            source,
            requested,
            out,
            engine_cfg,
            dict(job_cfg.target),
            job_menu_p(job_cfg, request),
            _profiles(cfg),
            writer,
            device=cfg.device,
            calibration=calibration,
        )
    else:
        report = quantize_checkpoint(
            source.path, out, engine_cfg, writer, device=cfg.device, calibration=calibration
        )
        if cfg.profiles is not None:
            annotate_uniform(sessions, source, cfg.profiles, report)
    engine_s = time.perf_counter() - t0
    report.source.update({"id": source.id, "revision": source.revision, "kind": source.kind})
    report.metrics.setdefault("service", {}).update(
        {"worker_id": worker_id, "engine_wall_s": round(engine_s, 4)}
    )
    if evaluate:
        t1 = time.perf_counter()
        es = EvalSettings(cfg.eval_text_file, cfg.eval_context, cfg.eval_windows)
        report.metrics.update(evaluate_artifact(source.path, out / "native", es, writer))
        report.timings["evaluating"] = time.perf_counter() - t1
    if (out / "report.json").exists():
        report.save(out / "report.json")
    final = publish_result(attempt, out, report, list(engine_cfg.formats), source.revision)
    log.info("job %s: succeeded in %.2f s (engine)", job_id, engine_s)
    return final


def _run_gguf(
    attempt: Attempt, job_cfg: JobConfig, source: Any, requested: str | None
) -> Path | None:
    """A GGUF job: llama.cpp's types per tensor for the target (worker.gguf)."""
    from worker.gguf import quantize_gguf_job

    cfg = attempt.cfg
    if job_cfg.evaluate and cfg.eval_text_file is None:
        raise InvalidConfigError(
            f"options.evaluate=true needs an evaluation text on the worker; set {EVAL_TEXT_ENV}"
        )
    attempt.staging.mkdir(parents=True, exist_ok=True)
    out = attempt.staging / "out"
    t0 = time.perf_counter()
    report = quantize_gguf_job(
        attempt.sessions,
        source,
        requested,
        out,
        dict(job_cfg.target),
        cfg.profiles,
        attempt.writer,
        eval_text_file=cfg.eval_text_file if job_cfg.evaluate else None,
        eval_context=cfg.eval_context,
        eval_windows=cfg.eval_windows,
        rotate=job_cfg.gguf_rotate,
    )
    engine_s = time.perf_counter() - t0
    report.source.update({"id": source.id, "revision": source.revision, "kind": source.kind})
    report.metrics.setdefault("service", {}).update(
        {"worker_id": attempt.worker_id, "engine_wall_s": round(engine_s, 4)}
    )
    report.save(out / "report.json")
    final = publish_result(attempt, out, report, ["gguf"], source.revision)
    log.info("job %s: succeeded in %.2f s (engine, gguf)", attempt.job_id, engine_s)
    return final


def job_menu_p(job_cfg: JobConfig, request: dict[str, Any]) -> int | None:
    """A dynamic job's option menu (options.p)."""
    if job_cfg.menu_p is not None:
        return job_cfg.menu_p
    p = (request.get("options") or {}).get("p")  # a config stored before JobConfig had menu_p
    return None if p is None else int(p)


def _profiles(cfg: RunnerConfig) -> ProfileSettings:
    if cfg.profiles is None:
        raise InvalidConfigError("this worker has no profile settings for dynamic targets")
    return cfg.profiles


def publish_result(
    attempt: Attempt, out: Path, report: Any, formats: list[str], model_revision: str | None
) -> Path:
    """Upload (or move into artifacts_dir) a finished output directory, record the job as
    succeeded with its report, layer and artifact rows in one transaction, and drop what
    earlier attempts left. Nothing stays published when the success cannot be recorded."""
    cfg, writer = attempt.cfg, attempt.writer
    if writer.stop.is_set():
        raise CancelledError("cancelled while packaging")
    store = cfg.store
    if store is not None:
        uri, rows = _upload(store, out, attempt.job_id, attempt.staging.name, formats, writer)
        final = out
    else:
        uri, final = "", publish(out, cfg.artifacts_dir, attempt.job_id, attempt.staging.name)
    try:
        if store is None:
            rows = artifact_rows(final, formats)
        record_success(attempt, report, rows, model_revision)
    except BaseException:
        # Not recorded as succeeded (cancelled meanwhile, lost, bad rows): unpublish.
        if store is not None:
            with contextlib.suppress(Exception):  # a store that is away: the next attempt clears
                store.delete_tree(uri)
        remove_tree(final)
        remove_empty_job_dir(cfg.artifacts_dir, attempt.job_id)
        raise
    drop_other_attempts(attempt, uri if store is not None else None, final)
    return final


def record_success(
    attempt: Attempt, report: Any, rows: list[ArtifactRow], model_revision: str | None
) -> None:
    """The job succeeded with its report, layer and artifact rows: one transaction (retried
    while the database is away; a retry after a commit whose reply was lost is no error)."""
    sessions, job_id, worker_id, cfg = (
        attempt.sessions,
        attempt.job_id,
        attempt.worker_id,
        attempt.cfg,
    )
    report_dict = json.loads(json.dumps(report.to_dict()))  # plain JSON types only
    tries = 0

    def record() -> None:
        nonlocal tries
        tries += 1
        try:
            with sessions() as s:
                state.succeed(
                    s,
                    job_id,
                    report_dict,
                    None,
                    rows,
                    worker_id=worker_id,
                    model_revision=model_revision,
                )
        except state.IllegalTransitionError:
            # A retry after a commit whose reply was lost finds the job already ours.
            if tries > 1 and _ours_now(sessions, job_id, worker_id, SUCCEEDED, cfg.db_retry_s):
                return
            raise

    retry_db(record, f"result of job {job_id}", cfg.db_retry_s)


def drop_other_attempts(attempt: Attempt, uri: str | None, final: Path) -> None:
    """Exactly one published artifact set per job: drop what earlier attempts left behind
    (`uri` in the store, or the local directory `final` when there is no store)."""
    cfg, job_id = attempt.cfg, attempt.job_id
    if cfg.store is not None:
        try:
            cfg.store.clear_job(job_id, keep=uri)
        except StoreUnavailableError as e:
            log.warning("job %s: earlier attempts' objects not removed: %s", job_id, e)
    else:
        prune_job_dir(cfg.artifacts_dir, job_id, keep=final)


def load_job_calibration(
    sessions: SessionFactory, entry: dict[str, Any] | None, model_path: Path, budget_s: float
) -> Any:
    """The engine Calibration for a job config's `calibration` entry (an uploaded text), or
    None. InvalidConfigError (the job fails, code invalid_config) when the upload is gone or
    the text has fewer tokens than the job asks for."""
    if not entry:
        return None
    from app.db.models import Calibration as CalibrationRow
    from higgs_engine.calibration import prepare_calibration

    def load() -> tuple[str, str] | None:
        with sessions() as s:
            row = s.get(CalibrationRow, entry["id"])
            return None if row is None else (row.text, row.sha256)

    found = retry_db(load, f"calibration {entry['id']}", budget_s)
    if found is None:
        raise InvalidConfigError(
            f"options.calibration: the upload {entry['id']!r} no longer exists"
        )
    text, sha = found
    if sha != entry.get("sha256"):
        raise InvalidConfigError(
            f"options.calibration: the upload {entry['id']!r} changed since submit"
        )
    try:
        return prepare_calibration(
            model_path, text, int(entry["tokens"]), label=f"upload:{entry['id']}"
        )
    except InvalidConfigError as exc:
        raise InvalidConfigError(f"options.calibration: {exc}") from exc


def _stop(
    sessions: SessionFactory, job_id: str, worker_id: str, why: str, budget_s: float = 300.0
) -> Outcome:
    """The engine stopped on request: cancelled if the user asked and we own the job; else lost."""
    job = _job_snapshot(sessions, job_id, budget_s)
    if job is None:
        return Outcome("lost", "the job row disappeared")
    if job.status == CANCELLED:
        return Outcome("cancelled", why)
    if job.status == RUNNING and job.worker_id == worker_id and job.cancel_requested:

        def cancel() -> None:
            with sessions() as s:
                state.mark_cancelled(s, job_id, worker_id=worker_id)

        retry_db(cancel, f"cancellation of job {job_id}", budget_s)
        log.info("job %s: cancelled (%s)", job_id, why)
        return Outcome("cancelled", why)
    log.warning(
        "job %s: stopped because this worker no longer owns it (now %s)", job_id, job.status
    )
    return Outcome("lost", why)
