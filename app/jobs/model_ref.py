"""Model references: a Hub id ("owner/name", or a legacy bare name) or, with HIGGS_MODELS_DIR
set, the name of a checkpoint directory inside it. Pure checks, shared by API and worker."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# The character rules of huggingface_hub's validate_repo_id.
_PART = r"[A-Za-z0-9_.\-]{1,96}"
# Used with fullmatch: `$` would also match before a final newline.
_HUB_ID = re.compile(rf"(?:{_PART}/)?{_PART}")
_REVISION = re.compile(r"[A-Za-z0-9_.\-/]{1,255}")


class ModelRefError(ValueError):
    """The reference is malformed or names nothing; `field` is the request field to blame."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "local" | "hub"
    id: str
    path: Path | None = None  # the directory, for local models
    revision: str | None = None


def _check_name(model_id: str) -> None:
    if "\\" in model_id or model_id.startswith("/") or model_id.count("/") > 1:
        raise ModelRefError(
            "model.id",
            f"model.id {model_id!r} must be a Hub id 'owner/name' or a local model name "
            "(no path separators)",
        )
    if ".." in model_id or "--" in model_id:
        raise ModelRefError("model.id", f"model.id {model_id!r} must not contain '..' or '--'")
    if not _HUB_ID.fullmatch(model_id) or any(
        part[0] in "-." or part[-1] in "-." or part.endswith(".git") for part in model_id.split("/")
    ):
        raise ModelRefError(
            "model.id",
            f"model.id {model_id!r} is not well-formed: use letters, digits, '-', '_', '.' "
            "(at most 96 per part), as 'owner/name' or a local name",
        )


class LocalNames(Protocol):
    """The registry of local models the workers have (app.jobs.local_models.Registry)."""

    def has(self, name: str) -> bool: ...

    def any(self) -> bool: ...

    def architecture(self, name: str) -> str | None: ...


def resolve_model(
    model_id: str,
    revision: str | None,
    models_dir: Path | None,
    registry: LocalNames | None = None,
) -> ModelSource:
    """Check a reference and say where it lives. A local name (no '/') is a model the
    workers registered (`registry`, the API's check: no disk needed), or a folder in
    models_dir when that is set here; with neither, a bare name is a legacy Hub id (e.g.
    "gpt2") unless the registry lists local models (then it is an unknown local model)."""
    _check_name(model_id)
    if revision is not None and (not _REVISION.fullmatch(revision) or ".." in revision):
        raise ModelRefError(
            "model.revision",
            f"model.revision {revision!r} must be a branch, tag or commit sha "
            "(letters, digits, '-', '_', '.', '/')",
        )
    if "/" not in model_id and registry is not None and registry.has(model_id):
        if revision is not None:
            raise ModelRefError(
                "model.revision",
                f"model.revision {revision!r} applies to Hub models only; {model_id!r} is a local model",
            )
        return ModelSource(kind="local", id=model_id, path=None)
    if "/" not in model_id and models_dir is None and registry is not None and registry.any():
        raise ModelRefError(
            "model.id",
            f"model.id {model_id!r} is not a model this service serves locally (a Hub "
            "model is named 'owner/name')",
        )
    if "/" not in model_id and models_dir is not None:
        path = models_dir / model_id
        if not path.is_dir():
            # Neither the server's folder nor the other models it serves are anyone's business.
            raise ModelRefError(
                "model.id",
                f"model.id {model_id!r} is not a model this service serves locally (a Hub "
                "model is named 'owner/name')",
            )
        if revision is not None:
            raise ModelRefError(
                "model.revision",
                f"model.revision {revision!r} applies to Hub models only; {model_id!r} is a local model",
            )
        return ModelSource(kind="local", id=model_id, path=path)
    return ModelSource(kind="hub", id=model_id, revision=revision)
