"""An attempt's staging directory under artifacts_dir, where the engine writes (never served):
its name, the removal of a tree (renamed out of the way first), and the leftovers of earlier,
killed attempts cleared before a new one starts.

    .staging/<job_id>.<attempt>.<hex>/          a job attempt, or a fanned-out job's assembly
    .staging/<job_id>-part<i>.<attempt>.<hex>/  one part of a fanned-out job
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

STAGING = ".staging"


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
