"""Helpers shared by the worker and end-to-end tests: a real Hugging Face cache layout, jobs
created through the API's own service functions, and a poll loop."""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")


def make_hub_cache(hub_cache: Path, repo_id: str, checkpoint: Path, branch: str = "main") -> str:
    """Lay `checkpoint` out as huggingface_hub stores a download, and return the commit sha:

        <hub_cache>/models--<owner>--<name>/blobs/<sha256 of each file>
                                           /snapshots/<commit>/<file> -> ../../blobs/<sha256>
                                           /refs/<branch>   (contains <commit>)
    """
    owner_name = repo_id.replace("/", "--")
    repo = hub_cache / f"models--{owner_name}"
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for p in files:
        data = p.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        dest = snap / p.relative_to(checkpoint)
        dest.parent.mkdir(parents=True, exist_ok=True)
        depth = len(p.relative_to(checkpoint).parts) + 1
        dest.symlink_to(Path(*([".."] * depth), "blobs", blob.name))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return commit


def copy_checkpoint(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def create_job(
    sessions: sessionmaker[Session], settings: Any, body: dict[str, Any], key_name: str = "test"
) -> str:
    """Insert a job exactly as POST /v1/jobs does (validation + row), without HTTP."""
    from app.jobs.schemas import JobCreate
    from app.jobs.service import create_job as create
    from app.jobs.service import validate_request
    from app.keys.service import create_key

    with sessions() as s:
        key, _ = create_key(s, key_name)
        spec = validate_request(JobCreate.model_validate(body), settings)
        job, _ = create(s, key, spec, None)
        return job.id


def wait_until(cond: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def cancel_mid_run(
    sessions: sessionmaker[Session],
    job_id: str,
    run: Callable[[], Any],
    ready: Callable[[], Any],
    what: str,
    timeout: float = 60,
) -> Any:
    """Run `run()` (one runner attempt) in a thread, request cancellation once `ready()` holds,
    and return the attempt's outcome after the runner stopped."""
    import threading

    from app.jobs import state

    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(run()))
    t.start()
    try:
        wait_until(ready, timeout, what)
        with sessions() as s:
            state.request_cancel(s, job_id)
    finally:
        t.join(60)
    assert not t.is_alive(), "the runner did not stop after the cancel request"
    assert result, "the runner thread raised"
    return result[0]
