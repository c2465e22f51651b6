"""Model sources for jobs: a named local model under models_dir, or a Hub id (pinned revision),
resolved into the engine's ResolvedModel (higgs_engine.sources) once per attempt.

The worker never hands a raw, user-supplied model id to code that treats existing paths as
local directories (the engine's resolve_source does): a local name is looked up only under
models_dir, and anything else must be a well-formed Hub id and goes through huggingface_hub
(its cache, offline mode and token). The engine then reads the directory found
(`describe_model`) and the model carries the job's identity (model id, commit sha, kind),
which is what the report's source names.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.keys.hub_token import HubTokens, HubTokenUnreadableError
from higgs_engine.errors import InvalidConfigError, ModelNotFoundError, UnsupportedModelError
from higgs_engine.sources import ResolvedModel, ResolvedSource, describe_model

# A Hub token, or a function that reads it when a Hub model needs it.
HubToken = str | Callable[[], str | None] | None
_SHA = re.compile(r"^[0-9a-f]{40}$")
# Files a quantization needs; never the *.bin / *.pt duplicates some repos carry as well.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]


@dataclass(frozen=True)
class ModelRequest:
    """Which model a job attempt reads and how this worker reaches it: the job's `model_id` at
    `revision` (a branch, tag or sha; None: the default branch), from models_dir or the Hub
    with the job's Hub token (job_hub_token) and the worker's offline mode."""

    model_id: str
    revision: str | None
    models_dir: Path | None
    token: HubToken
    offline: bool


def resolve_model(request: ModelRequest, shards: Sequence[str] | None = None) -> ResolvedModel:
    """The job's model found on this machine (`locate_model`; `shards` as it says) and
    described by the engine once (`describe_located`)."""
    return describe_located(locate(request, shards))


def locate(request: ModelRequest, shards: Sequence[str] | None = None) -> ResolvedSource:
    """locate_model for `request`."""
    return locate_model(
        request.model_id,
        request.revision,
        models_dir=request.models_dir,
        token=request.token,
        offline=request.offline,
        shards=shards,
    )


def describe_located(found: ResolvedSource) -> ResolvedModel:
    """The engine's description of the directory found (its config, layers and tensor names,
    read once) under the job's identity (model id, the commit sha read, "local" or "hub").
    Profiles stay keyed as the engine keys a local directory (its absolute path and content
    fingerprint)."""
    local = describe_model(ResolvedSource(found.path, str(found.path), None, "local"))
    return local.named(found.id, found.revision, found.kind)


def locate_model(
    model_id: str,
    revision: str | None,
    *,
    models_dir: Path | None,
    token: HubToken,
    offline: bool,
    shards: Sequence[str] | None = None,
) -> ResolvedSource:
    """Where the job's model lives on this machine, downloading Hub files into the HF cache.

    `token`: the Hub token to send, or a function that gives it (asked only for a Hub model:
    job_hub_token). None sends none: never the process's HF_TOKEN or stored login.

    `shards`: from the Hub, download only these safetensors files (one part of a fanned-out
    job; () = none, only config, shard index and tokenizer). None: every file.

    The reference is checked by the same rules as at submit (app.jobs.model_ref): a plain name
    is a directory under models_dir when that is set (no separators, no '..'); anything else
    is a Hub id. `revision` may be a branch, tag or sha; the snapshot's commit sha is returned
    so that a retry of the same job reads exactly the same files.
    """
    from app.jobs.model_ref import ModelRefError
    from app.jobs.model_ref import resolve_model as check_ref

    try:
        ref = check_ref(model_id, revision, models_dir)
    except ModelRefError as exc:
        raise ModelNotFoundError(str(exc)) from exc
    if ref.kind == "local" and ref.path is not None and models_dir is not None:
        refuse_outside_links(model_id, ref.path, models_dir)
        if not (ref.path / "config.json").is_file():
            raise UnsupportedModelError(f"local model {model_id!r} has no config.json")
        return ResolvedSource(path=ref.path, id=model_id, revision=None, kind="local")
    return _resolve_hub(
        model_id,
        revision,
        token=token() if callable(token) else token,
        offline=offline,
        shards=shards,
    )


def job_hub_token(
    sessions: sessionmaker[Session], job_id: str, tokens: HubTokens
) -> Callable[[], str | None]:
    """The Hub token of the job's API key, read when first asked (app.keys.hub_token: its own,
    else the service's where the operator allows it, else none). A stored token that does not
    decrypt fails the job (invalid_config) rather than running it without."""
    got: list[str | None] = []

    def read() -> str | None:
        if not got:
            from app.db.models import Job

            with sessions() as s:
                key_id = s.scalar(select(Job.api_key_id).where(Job.id == job_id))
                try:
                    got.append(tokens.for_key(s, key_id))
                except HubTokenUnreadableError as e:
                    raise InvalidConfigError(str(e), field="hub_token") from e
        return got[0]

    return read


def refuse_outside_links(model_id: str, path: Path, models_dir: Path) -> None:
    """A local model is read only from inside models_dir: a symbolic link (the model folder
    itself or anything in it) that points outside would put an arbitrary server file into
    the job's artifacts, so the job is refused instead."""
    root = models_dir.resolve()

    def outside(p: Path) -> bool:
        try:
            target = p.resolve()
        except (OSError, RuntimeError):  # a loop: refuse as well
            return True
        return target != root and root not in target.parents

    if outside(path):
        raise UnsupportedModelError(
            f"local model {model_id!r} is a symbolic link to a folder outside the models folder; "
            "copy it in (links are followed only within the models folder)"
        )
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            if p.is_symlink() and outside(p):
                rel = p.relative_to(path).as_posix()
                raise UnsupportedModelError(
                    f"local model {model_id!r}: {rel!r} is a symbolic link to a file outside the "
                    "models folder; copy the file in (links are followed only within the models folder)"
                )


def _resolve_hub(
    repo_id: str,
    revision: str | None,
    *,
    token: str | None,
    offline: bool,
    shards: Sequence[str] | None = None,
) -> ResolvedSource:
    from huggingface_hub import constants as hf_constants
    from huggingface_hub import model_info, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        if not offline and not hf_constants.HF_HUB_OFFLINE:
            # The Hub answers for this token first: snapshot_download would fall back on the
            # local cache after a 401/403, serving one key what another key's token fetched.
            model_info(repo_id, revision=revision, token=token or False)
        snap = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                # False: no token at all (None would send the process's HF_TOKEN or login).
                token=token or False,
                allow_patterns=(
                    HUB_PATTERNS
                    if shards is None
                    else [p for p in HUB_PATTERNS if p != "*.safetensors"] + list(shards)
                ),
                local_files_only=offline,
            )
        )
    except RevisionNotFoundError as exc:
        raise ModelNotFoundError(
            f"revision {revision!r} of {repo_id!r} does not exist on the Hub"
        ) from exc
    except GatedRepoError as exc:
        raise ModelNotFoundError(
            f"{repo_id!r} is gated: give this API key a Hub token with access "
            "(PUT /v1/keys/me/hub-token)"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a Hub repository (or it is private: give this API key "
            "a Hub token with access, PUT /v1/keys/me/hub-token)"
        ) from exc
    except LocalEntryNotFoundError as exc:
        where = "offline mode is on" if offline else "the Hub cannot be reached"
        raise ModelNotFoundError(
            f"model {repo_id!r} (revision {revision or 'main'!r}) is not in the Hugging Face cache "
            f"and {where}"
        ) from exc
    except Exception as exc:  # OSError, ValueError, the HTTP client's transport errors
        raise ModelNotFoundError(f"cannot fetch {repo_id!r} from the Hub: {exc}") from exc
    # The cache keeps each snapshot under snapshots/<commit sha>/: that name is what was read.
    sha = snap.name if _SHA.match(snap.name) else revision
    if shards is not None and not (snap / "model.safetensors.index.json").is_file():
        # Not sharded: there is no part to fetch alone; the whole snapshot is needed.
        return _resolve_hub(repo_id, sha, token=token, offline=offline)
    has_weights = any(snap.glob("*.safetensors")) or (
        shards is not None and (snap / "model.safetensors.index.json").is_file()
    )
    if not (snap / "config.json").is_file() or not has_weights:
        raise UnsupportedModelError(
            f"Hub repository {repo_id!r} has no config.json + *.safetensors checkpoint"
        )
    return ResolvedSource(path=snap, id=repo_id, revision=sha, kind="hub")


def register_local_models(sessions: sessionmaker[Session], models_dir: Path | None) -> list[str]:
    """Tell the API which local models this worker has: the checkpoint folders of models_dir
    (valid model names with a config.json), registered under "<host>:<models dir>" (rows of
    names that are gone are removed). Called on every sweep, so the rows stay fresh."""
    if models_dir is None:
        return []
    from app.jobs.local_models import read_architecture, register, scan_models_dir
    from app.jobs.model_ref import ModelRefError
    from app.jobs.model_ref import resolve_model as check_ref

    names = []
    for name in scan_models_dir(models_dir):
        try:
            check_ref(name, None, None)
        except ModelRefError:
            continue
        names.append(name)
    holder = f"{socket.gethostname()}:{models_dir}"[:255]
    archs = {n: read_architecture(models_dir / n) for n in names}
    with sessions() as s:
        register(s, names, holder, architectures=archs)
    return names
