"""An attempt's files published: the engine's finished output (written under the attempt's
staging directory, worker.staging) moved into artifacts_dir in one rename or uploaded to the
artifact store, the success recorded with the artifact rows (worker.attempt.record_success),
and what earlier attempts of the job left dropped. Nothing stays published when the success
cannot be recorded.

Directory layout under artifacts_dir:
    .staging/<job_id>.<attempt>.<hex>/   the engine writes here (never served)
    <job_id>/<attempt>.<hex>/<format>/   published attempt, referenced by the artifact rows
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from app.artifacts.manifest import artifact_rows as manifest_rows
from app.artifacts.store import ArtifactStore, StoreUnavailableError, UploadFile, join_uri
from app.jobs.rows import ArtifactRow
from higgs_engine.artifact_check import verify_artifacts
from higgs_engine.errors import CancelledError, HiggsError
from worker.attempt import Attempt, record_success
from worker.progress import ProgressWriter
from worker.staging import remove_tree

# An attempt's records go out under the runner's logger name, wherever they are written.
log = logging.getLogger("worker.runner")


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


def publish_result(
    attempt: Attempt, out: Path, report: Any, formats: list[str], model_revision: str | None
) -> Path:
    """Load every artifact with its engine (higgs_engine.artifact_check), upload (or move into
    artifacts_dir) a finished output directory, record the job as
    succeeded with its report, layer and artifact rows in one transaction, and drop what
    earlier attempts left. Nothing stays published when the success cannot be recorded."""
    cfg, writer = attempt.cfg, attempt.writer
    if writer.stop.is_set():
        raise CancelledError("cancelled while packaging")
    # Nothing succeeds that its engine cannot load (CorruptCheckpointError otherwise).
    verify_artifacts(out, formats)
    store = cfg.store
    if store.on_disk:  # one rename into artifacts_dir; the rows are read from the moved files
        uri, final = "", publish(out, cfg.artifacts_dir, attempt.job_id, attempt.staging.name)
    else:
        uri, rows = _upload(store, out, attempt.job_id, attempt.staging.name, formats, writer)
        final = out
    try:
        if store.on_disk:
            rows = artifact_rows(final, formats)
        record_success(attempt, report, rows, model_revision)
    except BaseException:
        # Not recorded as succeeded (cancelled meanwhile, lost, bad rows): unpublish.
        if not store.on_disk:
            with contextlib.suppress(Exception):  # a store that is away: the next attempt clears
                store.delete_tree(uri)
        remove_tree(final)
        remove_empty_job_dir(cfg.artifacts_dir, attempt.job_id)
        raise
    drop_other_attempts(attempt, uri, final)
    return final


def drop_other_attempts(attempt: Attempt, uri: str, final: Path) -> None:
    """Exactly one published artifact set per job: drop what earlier attempts left behind
    (in a local folder store: every folder of the job but `final`; in a remote store: every
    object of the job outside `uri`)."""
    cfg, job_id = attempt.cfg, attempt.job_id
    if cfg.store.on_disk:
        prune_job_dir(cfg.artifacts_dir, job_id, keep=final)
        return
    try:
        cfg.store.clear_job(job_id, keep=uri)
    except StoreUnavailableError as e:
        log.warning("job %s: earlier attempts' objects not removed: %s", job_id, e)
