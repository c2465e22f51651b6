"""Artifact listing and file lookup for the caller's succeeded jobs."""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.artifacts.store import StoreObjectMissingError
from app.db.models import SUCCEEDED, Artifact, ArtifactFile
from app.errors import BadRequestError, NotFoundError
from app.jobs import repository
from app.jobs.schemas import ArtifactOut
from app.jobs.service import get_job, job_url
from app.keys.service import AuthKey


class ArtifactNotFound(NotFoundError):
    code = "artifact_not_found"


def get_artifact(session: Session, key: AuthKey, job_id: str, fmt: str) -> Artifact:
    job = get_job(session, key, job_id)
    art = repository.artifact(session, job.id, fmt) if job.status == SUCCEEDED else None
    if art is None:
        raise ArtifactNotFound(
            f"job {job_id} has no {fmt!r} artifact"
            + (
                ""
                if job.status == SUCCEEDED
                else f" (status {job.status}; artifacts exist once it succeeded)"
            )
        )
    return art


def check_file_path(path: str) -> str:
    parts = path.split("/")
    if not path or "\\" in path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise BadRequestError(
            f"file path {path!r} must be a relative path inside the artifact, without '..'"
        )
    return path


def resolve_file(art: Artifact, path: str) -> ArtifactFile:
    """The listed file (a path that is not listed is a 404; the store is not asked)."""
    check_file_path(path)
    row = next((f for f in art.files if f.path == path), None)
    if row is None:
        raise ArtifactNotFound(f"artifact {art.format!r} of job {art.job_id} has no file {path!r}")
    return row


def missing(art: Artifact, path: str) -> StoreObjectMissingError:
    return StoreObjectMissingError(
        f"file {path!r} of artifact {art.format!r} (job {art.job_id}) is missing from the store"
    )


def artifact_view(art: Artifact) -> ArtifactOut:
    base = f"{job_url(art.job_id)}/artifacts/{art.format}"
    return ArtifactOut.model_validate(
        {
            "job_id": art.job_id,
            "format": art.format,
            "bytes": art.total_bytes,
            "sha256": art.sha256,
            "files": [
                {
                    "path": f.path,
                    "bytes": f.bytes,
                    "sha256": f.sha256,
                    "url": f"{base}/files/{f.path}",
                }
                for f in art.files
            ],
            "archive_url": f"{base}/archive",
        }
    )
