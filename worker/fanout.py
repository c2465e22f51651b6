"""One job over many workers: a sharded source quantized part by part, then assembled, all
by one job plan (higgs_engine.job.JobPlan) made once by the coordinator.

    run_job (the coordinator, worker.runner): claims the job, resolves the model once (for a
        Hub model only its shard index), plans the job (higgs_engine.job.plan; a dynamic
        target's profile and allocation too) and, when the source has several shards, records
        one job_parts row per part carrying the plan (app.jobs.parts.fan_out) and dispatches
        a Celery chord: group(run_part(job, attempt, i) for each part) | assemble(job, attempt)
    run_part (any worker): claims its part (compare-and-set), resolves the model with only its
        own shards fetched, runs its part of the stored plan (higgs_engine.job.run_part) with
        progress + heartbeats on the part row (summed into the job's) and writes its shard
        files (native and dequantized, named by the plan: model-0000k-of-0000N.safetensors)
        straight to where the published artifact will be: the job attempt's artifact location
        in the store, which no artifact row names until the assembly publishes it (a local
        store: one rename). The part row records the part's metadata (every file's bytes and
        sha256, tensor names, layer rows) and the part is done
    assemble (the chord's callback, or the sweep's barrier when a host died and took the
        chord's message with it): claims the assembly once every part is done, checks that
        every part's shard is in the store with its recorded size, writes only the small files
        by the stored plan from the parts' recorded metadata and the model's small files
        (higgs_engine.job.assemble: the indexes, configs, tokenizer files, the grids shard,
        report.json with the plan's annotations), puts those beside the parts' shards and
        publishes the artifact rows (every file with its sha256, the parts' included) in one
        transaction. No weight shard is downloaded or uploaded again, nothing is planned again

A part that fails for a reason other than a lost worker fails the job with its error and
cancels its siblings; a cancel stops every part, publishes nothing and removes every part's
output. A part whose process died goes back to the queue (bounded attempts) through the
pool's WorkerLostError (worker.tasks.PartRequest) or the part sweep (app.jobs.parts); its
next run writes the same keys again (same bytes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.artifacts.manifest import manifest_sha256, sha256_file
from app.artifacts.store import (
    ArtifactStore,
    StoreUnavailableError,
    UploadFile,
    join_uri,
    uri_path,
)
from app.db.models import CANCELLED, FAILED, RUNNING
from app.jobs import parts as part_state
from app.jobs.rows import ArtifactRow, FileRow
from higgs_engine.errors import CancelledError, CorruptCheckpointError, InvalidConfigError
from worker.attempt import (
    Attempt,
    Claimed,
    Outcome,
    default_worker_id,
    fail_job,
    job_error_code,
    job_snapshot,
    record_success,
)
from worker.config import RunnerConfig
from worker.dbretry import DatabaseUnavailableError, SessionFactory, retry_db
from worker.dynamic import annotate_uniform, profile_entry
from worker.messages import message_roots, public_message
from worker.models import ModelRequest, job_hub_token, resolve_model
from worker.progress import PartProgress, ProgressWriter, heartbeating
from worker.publish import drop_other_attempts
from worker.staging import clear_stale_staging, remove_tree, staging_dir

if TYPE_CHECKING:
    from higgs_engine.job import JobPlan
    from higgs_engine.report import Report

log = logging.getLogger("worker.fanout")


def attempt_name(job_id: str, attempt: int) -> str:
    """The artifact location's name of a fanned-out job attempt: fixed, so that every part
    knows it (a single-worker attempt's has a random suffix)."""
    return f"{job_id}.{attempt}.parts"


def artifact_uri(store: ArtifactStore, job_id: str, attempt: int) -> str:
    """Where a fanned-out attempt's artifact is published (formats are folders below it); the
    parts write their shards there, the assembly the small files."""
    return store.attempt_uri(job_id, attempt_name(job_id, attempt))


# ---------------------------------------------------------------- the coordinator


def is_sharded(path: Path) -> bool:
    """The checkpoint directory has a shard index naming several shards."""
    from higgs_engine.safetensors_stream import read_weight_map

    weight_map = read_weight_map(path)
    return weight_map is not None and len(set(weight_map.values())) > 1


def start_fanout(attempt: Attempt, plan: JobPlan) -> None:
    """Fan the claimed job out by its sharded `plan`: one part row per part, each carrying
    the plan, then the chord dispatched (or left to the sweep when the broker is away)."""
    if attempt.dispatch is None or not plan.sharded:
        raise InvalidConfigError("only a sharded plan with a dispatcher fans out")
    dispatch = attempt.dispatch
    specs = [
        part_state.PartSpec(p.index, p.shards, total)
        for p, total in zip(plan.parts, plan.totals, strict=True)
    ]
    job_id, attempt_no = attempt.job_id, attempt.claimed.attempt
    stored = plan.to_dict()

    def record() -> bool:
        with attempt.sessions() as s:
            return part_state.fan_out(s, job_id, attempt.worker_id, attempt_no, specs, stored)

    if not retry_db(record, f"fan-out of job {job_id}", attempt.cfg.db_retry_s):
        raise CancelledError("the job stopped before its parts were recorded")
    idxs = [p.idx for p in specs]
    if dispatch(job_id, attempt_no, idxs):
        with attempt.sessions() as s:
            part_state.mark_parts_enqueued(s, job_id, attempt_no, idxs)
    else:
        log.warning("job %s: parts not sent (broker away); the sweep sends them", job_id)
    log.info("job %s: fanned out into %d parts (attempt %d)", job_id, len(specs), attempt_no)


def stored_plan(plan: dict[str, Any] | None) -> JobPlan:
    """The job plan a part row carries (CorruptCheckpointError for a row without one)."""
    from higgs_engine.job import JobPlan

    if plan is None:
        raise CorruptCheckpointError("the job's part rows carry no job plan (fanned out earlier)")
    return JobPlan.from_dict(plan)


# ---------------------------------------------------------------- a part


def _cancel_if_asked(
    sessions: SessionFactory, store: ArtifactStore, job_id: str, attempt: int, budget_s: float
) -> bool:
    """When the job's cancel was asked: cancel it with its parts and remove every part's
    output. True when the job is (now) cancelled."""
    job = job_snapshot(sessions, job_id, budget_s)
    if job is None or job.attempts != attempt:
        return False
    if job.status == RUNNING and job.cancel_requested:
        with sessions() as s:
            part_state.cancel_fanout(s, job_id, attempt)
        job = job_snapshot(sessions, job_id, budget_s)
    if job is not None and job.status == CANCELLED:
        _remove_parts(store, job_id, attempt)
        return True
    return False


def _remove_parts(store: ArtifactStore, job_id: str, attempt: int) -> None:
    """A fanned-out job that stopped without success: every object of it goes (its parts'
    outputs, open multipart uploads); nothing of it was published."""
    try:
        store.clear_job(job_id, keep=None)
    except StoreUnavailableError as e:  # the next attempt or the job's success clears them
        log.warning("job %s: parts' objects not removed: %s", job_id, e)


@dataclass(frozen=True)
class PartAttempt:
    """One attempt at one part: the part's ids, this worker, its progress writer (which
    beats the part's heartbeat and says when to stop), its staging and the attempt's
    artifact location."""

    sessions: SessionFactory
    job_id: str
    attempt: int
    idx: int
    worker_id: str
    cfg: RunnerConfig
    writer: PartProgress
    staging: Path
    uri: str


def run_part(
    sessions: SessionFactory,
    job_id: str,
    attempt: int,
    idx: int,
    cfg: RunnerConfig,
    worker_id: str | None = None,
) -> Outcome:
    """One attempt at one part. Idempotent: a part that is not queued is left alone."""
    worker_id = worker_id or default_worker_id()
    store = cfg.store

    def claim() -> part_state.PartClaim | None:
        with sessions() as s:
            return part_state.claim_part(s, job_id, attempt, idx, worker_id)

    try:
        claimed = retry_db(claim, f"claim of job {job_id} part {idx}", cfg.db_retry_s)
    except DatabaseUnavailableError as exc:
        return Outcome("lost", str(exc))
    if claimed is None:
        if _cancel_if_asked(sessions, store, job_id, attempt, cfg.db_retry_s):
            return Outcome("cancelled", f"part {idx}: the job was cancelled")
        return Outcome("skipped")
    log.info(
        "job %s part %d (%s): claimed by %s", job_id, idx, ", ".join(claimed.shards), worker_id
    )
    # What an earlier, killed attempt at this part left on this worker's disk.
    clear_stale_staging(cfg.artifacts_dir, f"{job_id}-part{idx}")
    at = PartAttempt(
        sessions,
        job_id,
        attempt,
        idx,
        worker_id,
        cfg,
        PartProgress(sessions, job_id, attempt, idx, worker_id, cfg),
        staging_dir(cfg.artifacts_dir, f"{job_id}-part{idx}", attempt),
        artifact_uri(store, job_id, attempt),
    )
    try:
        with heartbeating(at.writer, cfg.heartbeat_interval_s):
            seconds = _quantize_and_store(at, claimed)
        log.info("job %s part %d: done in %.2f s", job_id, idx, seconds)
        return Outcome("succeeded")
    except Exception as exc:
        return _part_ended(at, exc)
    finally:
        remove_tree(at.staging)


def _quantize_and_store(at: PartAttempt, claimed: part_state.PartClaim) -> float:
    """The part run by the job's plan on the model resolved here (only the part's shards
    fetched), its files stored where the artifact will be published, the part recorded
    done. Returns the part's seconds."""
    from higgs_engine.job import RunInputs, run_part

    t0 = time.perf_counter()
    plan = stored_plan(claimed.plan)
    requested = (claimed.request.get("model") or {}).get("revision")
    cfg = at.cfg
    request = ModelRequest(
        claimed.model_id,
        claimed.model_revision or requested,
        cfg.models_dir,
        job_hub_token(at.sessions, at.job_id, cfg.hub_tokens),
        cfg.hf_offline,
    )
    model = resolve_model(request, shards=claimed.shards)
    out = at.staging / "part"
    at.staging.mkdir(parents=True, exist_ok=True)
    inputs = RunInputs(model, at.writer, device=cfg.device)
    result = run_part(plan, at.idx, out, inputs)
    if at.writer("uploading", 0, 1) is False:
        raise CancelledError("cancelled before the part was stored")
    files = [
        UploadFile(rel, out / rel, str(f["sha256"]))
        for rel, f in sorted(result.meta["files"].items())
    ]
    # Straight to the attempt's artifact location (a retry writes the same keys).
    if not cfg.store.put(at.uri, files, lambda: at.writer.stop.is_set()):
        raise CancelledError("cancelled while storing the part")
    seconds = time.perf_counter() - t0

    def finish() -> bool:
        with at.sessions() as s:
            return part_state.finish_part(
                s, at.job_id, at.attempt, at.idx, at.worker_id, seconds, at.uri, result.meta
            )

    if not retry_db(finish, f"end of job {at.job_id} part {at.idx}", cfg.db_retry_s):
        raise CancelledError("the job stopped while the part was stored")
    return seconds


def _part_ended(at: PartAttempt, exc: Exception) -> Outcome:
    """How a part attempt that raised ends: lost (the database or the job away), cancelled,
    back in the queue (the store away), or failed (the job fails, its parts' objects go)."""
    sessions, store, job_id, attempt, idx = at.sessions, at.cfg.store, at.job_id, at.attempt, at.idx
    budget = at.cfg.db_retry_s
    if isinstance(exc, DatabaseUnavailableError):
        log.error("job %s part %d: attempt abandoned: %s", job_id, idx, exc)
        return Outcome("lost", str(exc))
    if isinstance(exc, CancelledError):
        if _cancel_if_asked(sessions, store, job_id, attempt, budget):
            return Outcome("cancelled", str(exc))
        # Lost: the part's next run writes the same keys; a job attempt that ended without
        # success has its objects removed here (nothing of it can be published any more).
        _drop_if_dead(sessions, store, job_id, attempt, budget)
        return Outcome("lost", str(exc))
    if isinstance(exc, StoreUnavailableError):
        # The part goes back to the queue unsent; the sweep sends it again.
        log.error("job %s part %d: artifact store unavailable (%s)", job_id, idx, exc)
        with sessions() as s:
            part_state.release_lost_part(
                s, job_id, attempt, idx, at.worker_id, 10**9, str(exc), message_returns=False
            )
        return Outcome("storage_unavailable", str(exc))
    code = job_error_code(exc)
    message = public_message(exc, message_roots(at.cfg))
    log.warning("job %s part %d failed: %s: %s", job_id, idx, code, message)

    def fail() -> bool:
        with sessions() as s:
            return part_state.fail_part(s, job_id, attempt, idx, at.worker_id, code, message)

    if retry_db(fail, f"failure of job {job_id} part {idx}", budget):
        _remove_parts(store, job_id, attempt)
    else:
        _drop_if_dead(sessions, store, job_id, attempt, budget)
    return Outcome("failed", f"{code}: {message}")


def _drop_if_dead(
    sessions: SessionFactory, store: ArtifactStore, job_id: str, attempt: int, budget_s: float
) -> None:
    """Remove the attempt's artifact location when the job ended without success or moved on
    to another attempt (what a part wrote there late can never be published)."""
    try:
        job = job_snapshot(sessions, job_id, budget_s)
    except Exception:  # the database away: the job's end or next attempt clears it
        return
    if job is None or job.attempts != attempt or job.status in (FAILED, CANCELLED):
        try:
            store.delete_tree(artifact_uri(store, job_id, attempt))
        except StoreUnavailableError as e:
            log.warning("job %s: a stopped attempt's objects not removed: %s", job_id, e)


# ---------------------------------------------------------------- the assembly


def assemble(
    sessions: SessionFactory,
    job_id: str,
    attempt: int,
    cfg: RunnerConfig,
    worker_id: str | None = None,
    trigger: str = "chord",
) -> Outcome:
    """Assemble and publish a fanned-out job once every part is done (one assembler wins the
    compare-and-set; a duplicate or early call is a no-op). `trigger` ("chord" or "sweep":
    what sent it) is recorded in the report."""
    worker_id = worker_id or default_worker_id()
    store = cfg.store

    def claim() -> bool:
        with sessions() as s:
            return part_state.claim_assembly(s, job_id, attempt, worker_id)

    try:
        won = retry_db(claim, f"assembly of job {job_id}", cfg.db_retry_s)
    except DatabaseUnavailableError as exc:
        return Outcome("lost", str(exc))
    if not won:
        if _cancel_if_asked(sessions, store, job_id, attempt, cfg.db_retry_s):
            return Outcome("cancelled", "the job was cancelled")
        return Outcome("skipped")
    job = job_snapshot(sessions, job_id, cfg.db_retry_s)
    if job is None:
        return Outcome("lost", "the job row disappeared")
    claimed = Claimed(
        job.model_id, dict(job.request), dict(job.config), job.model_revision, attempt
    )
    writer = ProgressWriter(
        sessions,
        job_id,
        worker_id,
        min_interval=cfg.progress_min_interval_s,
        db_retry_s=cfg.db_retry_s,
    )
    staging = staging_dir(cfg.artifacts_dir, job_id, attempt)
    at = Attempt(sessions, job_id, worker_id, cfg, writer, staging, claimed)
    try:
        with heartbeating(writer, cfg.heartbeat_interval_s):
            views = _assemble_and_publish(at, trigger)
        drop_other_attempts(at, artifact_uri(store, job_id, attempt), _published(at))
        log.info("job %s: assembled from %d parts by %s", job_id, len(views), worker_id)
        return Outcome("succeeded")
    except DatabaseUnavailableError as exc:
        # The parts' files stay where they are for the assembly's next run.
        log.error("job %s: assembly abandoned: %s", job_id, exc)
        return Outcome("lost", str(exc))
    except CancelledError as exc:
        job = job_snapshot(sessions, job_id, cfg.db_retry_s)
        if job is not None and job.status == RUNNING and job.cancel_requested:
            with sessions() as s:
                from app.jobs import state

                state.mark_cancelled(s, job_id, worker_id=worker_id)
        _remove_parts(store, job_id, attempt)
        return Outcome("cancelled", str(exc))
    except StoreUnavailableError as exc:
        # The job's stage goes back to the parts' once its heartbeat stops; the barrier
        # sends the assembly again (the parts' files stay).
        log.error("job %s: assembly: artifact store unavailable (%s)", job_id, exc)
        return Outcome("storage_unavailable", str(exc))
    except Exception as exc:
        out_c = fail_job(sessions, job_id, worker_id, cfg, exc)
        _remove_parts(store, job_id, attempt)
        return out_c
    finally:
        remove_tree(staging)


def _published(at: Attempt) -> Path:
    """What drop_other_attempts keeps: the attempt's folder (a local store) or its staging."""
    uri = artifact_uri(at.cfg.store, at.job_id, at.claimed.attempt)
    return uri_path(uri) if at.cfg.store.on_disk else at.staging / "out"


def _assemble_and_publish(at: Attempt, trigger: str) -> list[part_state.PartView]:
    """Every part's files checked in the store, the small files written by the job's plan
    from the parts' metadata (the model resolved here: config, shard index and tokenizer
    files only), uploaded, and the job's success recorded. Returns the parts."""
    from higgs_engine.job import RunInputs, assemble

    t0 = time.perf_counter()
    cfg, writer, claimed = at.cfg, at.writer, at.claimed
    uri = artifact_uri(cfg.store, at.job_id, claimed.attempt)
    with at.sessions() as s:
        views = part_state.parts_of(s, at.job_id, claimed.attempt)
    plan = stored_plan(views[0].plan)
    metas = _part_metas(views, uri)
    writer("packaging", 0, len(views) + 1)
    # Every part's shard where its part said, with its recorded size (no byte read).
    for n, v in enumerate(views):
        _check_stored(cfg.store, uri, v.idx, metas[n])
        writer("packaging", n + 1, len(views) + 1)
    requested = (claimed.request.get("model") or {}).get("revision")
    request = ModelRequest(
        claimed.model_id,
        claimed.pinned or requested,
        cfg.models_dir,
        job_hub_token(at.sessions, at.job_id, cfg.hub_tokens),
        cfg.hf_offline,
    )
    model = resolve_model(request, shards=())

    def annotate(report: Report, _staged: Path) -> None:
        if plan.dynamic is not None:
            report.metrics.setdefault("service", {})["profile"] = profile_entry(plan, model)
        elif cfg.profiles is not None:
            annotate_uniform(at.sessions, model, cfg.profiles, report)
        report.metrics["parts"] = [
            {
                "index": v.idx,
                "shards": v.shards,
                "worker_id": v.worker_id,
                "seconds": v.seconds,
                "attempts": v.attempts,
            }
            for v in views
        ]
        report.timings["quantizing"] = sum(v.seconds or 0.0 for v in views)
        report.metrics.setdefault("service", {}).update(
            {
                "worker_id": at.worker_id,
                "assembly_trigger": trigger,
                "assembly_wall_s": round(time.perf_counter() - t0, 4),
            }
        )

    # report.json is written once, with the service's entries, before anything is published.
    out = at.staging / "out"
    inputs = RunInputs(model, annotate=annotate, device=cfg.device)
    report = assemble(plan, metas, out, inputs)
    rows = _publish_small_files(at, cfg.store, uri, out, list(plan.config.formats), metas)
    record_success(at, report, rows, model.revision)
    return views


def _part_metas(views: list[part_state.PartView], uri: str) -> list[dict[str, Any]]:
    """Every part's recorded metadata; each part must have stored its files under `uri`."""
    metas = []
    for v in views:
        if v.output is None or v.output_uri != uri:
            raise CorruptCheckpointError(
                f"part {v.idx} is done but recorded no output under the job attempt's artifact "
                f"location (it recorded {v.output_uri!r})"
            )
        metas.append(v.output)
    return metas


def _check_stored(store: ArtifactStore, uri: str, idx: int, meta: dict[str, Any]) -> None:
    for rel, f in sorted(meta["files"].items()):
        size = store.stat(uri, rel)
        if size != int(f["bytes"]):
            raise CorruptCheckpointError(
                f"part {idx}'s file {rel!r} has {size} bytes in the store, not the "
                f"{f['bytes']} the part recorded"
            )


def _publish_small_files(
    at: Attempt,
    store: ArtifactStore,
    uri: str,
    out: Path,
    formats: list[str],
    metas: list[dict[str, Any]],
) -> list[ArtifactRow]:
    """Put the assembly's small files beside the parts' shards under `uri` and return the
    artifact rows naming every file (the parts' with the sha256 they recorded). Open multipart
    uploads left under `uri` by a part's lost run are aborted."""
    small: list[UploadFile] = []
    listed: dict[str, list[FileRow]] = {fmt: [] for fmt in formats}
    for fmt in formats:
        for p in sorted((out / fmt).iterdir()):
            sha = sha256_file(p)
            small.append(UploadFile(f"{fmt}/{p.name}", p, sha))
            listed[fmt].append(FileRow(p.name, p.stat().st_size, sha))
    for m in metas:
        for rel, f in m["files"].items():
            fmt, name = rel.split("/", 1)
            listed[fmt].append(FileRow(name, int(f["bytes"]), str(f["sha256"])))
    if store.on_disk:  # a local artifact directory holds its report like publish()'s
        small.append(UploadFile("report.json", out / "report.json", ""))
    done = 0

    def should_stop() -> bool:
        nonlocal done
        go = at.writer("uploading", done, len(small))
        done += 1
        return not go

    if not store.put(uri, small, should_stop):
        raise CancelledError("cancelled while storing the artifacts' small files")
    at.writer("uploading", len(small), len(small))
    store.abort_uploads(uri)
    rows = []
    for fmt in formats:
        files = tuple(sorted(listed[fmt], key=lambda f: f.path))
        rows.append(
            ArtifactRow(
                format=fmt,
                uri=join_uri(uri, fmt),
                files=files,
                total_bytes=sum(f.bytes for f in files),
                sha256=manifest_sha256((f.path, f.sha256) for f in files),
            )
        )
    return rows
