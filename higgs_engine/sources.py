"""Where a checkpoint comes from: a local directory, a GGUF file (converted once into a cached
safetensors checkpoint, since transformers can only load GGUF whole) or a Hugging Face Hub id
(a snapshot download of only the files a checkpoint needs), resolved to a local directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
import shutil
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from higgs_engine.errors import (
    ModelNotFoundError,
    UnsupportedModelError,
)

if TYPE_CHECKING:
    from higgs_engine.model_structure import LayerSpec

SourceKind = Literal["local", "hub", "gguf"]

# Files a snapshot needs; never the *.bin / *.pt duplicates some repos carry as well.
_HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.model",
    "*.txt",
    "*.tiktoken",
    "tokenizer*",
]
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_SHA = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class ResolvedSource:
    """A model reference turned into a local directory holding config.json + safetensors."""

    path: Path  # the directory to read
    id: str  # what the caller passed (Hub id or local path as given)
    revision: str | None  # resolved commit sha for Hub ids; None for local directories
    kind: SourceKind  # "local", "hub", or "gguf" (converted into a cache directory)


class SourceIdentity(Protocol):
    """What names a resolved model and where it is: ResolvedSource and ResolvedModel both."""

    @property
    def path(self) -> Path: ...

    @property
    def id(self) -> str: ...

    @property
    def revision(self) -> str | None: ...

    @property
    def kind(self) -> SourceKind: ...


@dataclass(frozen=True)
class ResolvedModel:
    """A model resolved once per run and passed down to every stage (profile, planning, the
    quantization, calibration, parts, the report): where it is and what it is, read once.

    `path`, `id`, `revision`, `kind` are the ResolvedSource's (id, revision and kind are what
    the report's source names); `config` is config.json as read (quantization_config
    dropped), `model_kind` "causal" or "encoder", `keys` every stored tensor name (from the
    shard index when there is one), `weight_map` the shard index ({tensor: shard file}, None
    for an unsharded checkpoint), `linear` the quantizable linear layers (keys matched to the
    stored names) and `embeddings` the token embedding and an untied head (keys as the module
    names them; `specs("all")` matches them). `profile_id` and `profile_rev` are what the
    engine's profile stores key the model by (the resolved id, a local model by its absolute
    path; the revision, or None: the checkpoint's content fingerprint). `hf_config` is the
    transformers config object the layers were found from."""

    path: Path
    id: str
    revision: str | None
    kind: SourceKind
    config: dict[str, Any]
    model_kind: str
    max_positions: int | None
    keys: tuple[str, ...]
    weight_map: dict[str, str] | None
    linear: tuple[LayerSpec, ...]
    embeddings: tuple[LayerSpec, ...]
    prefix: str
    profile_id: str
    profile_rev: str | None
    hf_config: Any = field(compare=False, repr=False)

    @property
    def sharded(self) -> bool:
        """The checkpoint has a shard index naming several shard files."""
        return self.weight_map is not None and len(set(self.weight_map.values())) > 1

    @property
    def architecture(self) -> str | None:
        first = (getattr(self.hf_config, "architectures", None) or [None])[0]
        return None if first is None else str(first)

    @cached_property
    def profile_revision(self) -> str:
        """The revision profiles and self-generated text are keyed by: `profile_rev`, else
        the checkpoint's content fingerprint (computed once)."""
        from higgs_engine.planning.profile import source_fingerprint

        return self.profile_rev or source_fingerprint(self.path)

    def specs(self, scope: str = "linear") -> list[LayerSpec]:
        """The layers a run of `scope` quantizes: the linear layers, and with scope "all" the
        token embedding first and an untied output head last, keys matched to the stored
        names (model_structure.scope_specs, without building the model again)."""
        if scope != "all":
            return list(self.linear)
        from higgs_engine.model_structure import match_spec_keys

        extra = [match_spec_keys(s, set(self.keys), self.prefix) for s in self.embeddings]
        return (
            [s for s in extra if s.role == "embedding"]
            + list(self.linear)
            + [s for s in extra if s.role != "embedding"]
        )

    def layer_names(self, skip: tuple[str, ...] = (), embeddings: bool = False) -> list[str]:
        """The quantizable linear layers' names less `skip`; with `embeddings` the token
        embedding and an untied head after them (what a profile covers)."""
        from higgs_engine.model_structure import is_skipped

        names = [s.name for s in self.linear if not is_skipped(s.name, skip)]
        if embeddings:
            names += [s.name for s in self.embeddings if s.name not in names]
        return names

    def ref(self) -> dict[str, Any]:
        """The serialisable part: what a job plan records of its source."""
        return {"path": str(self.path), "id": self.id, "revision": self.revision, "kind": self.kind}

    def named(self, id: str, revision: str | None, kind: SourceKind) -> ResolvedModel:
        """The same model under the identity a caller gives it (the service's model id, its
        pinned revision); the profile keys stay the resolution's."""
        return dataclasses.replace(self, id=id, revision=revision, kind=kind)


def describe_model(src: ResolvedSource) -> ResolvedModel:
    """The ResolvedModel of a resolved source: its config read and its model built on the meta
    device once, its layers found, its tensor names listed (no weight is read)."""
    from higgs_engine.model_structure import (
        build_meta_model,
        embedding_specs,
        layer_specs,
        load_config,
        max_positions,
        model_kind,
    )
    from higgs_engine.safetensors_stream import CheckpointReader, read_weight_map

    hf_config = load_config(src.path)
    weight_map = read_weight_map(src.path)
    if weight_map is not None:
        keys = list(weight_map)
    else:
        with CheckpointReader(src.path) as reader:
            keys = reader.keys()
    meta = build_meta_model(hf_config)
    linear = layer_specs(hf_config, keys, model=meta)
    embeddings = embedding_specs(hf_config, None, model=meta)
    raw = hf_config.to_dict()
    return ResolvedModel(
        path=src.path,
        id=src.id,
        revision=src.revision,
        kind=src.kind,
        config=raw,
        model_kind=model_kind(hf_config),
        max_positions=max_positions(hf_config),
        keys=tuple(keys),
        weight_map=weight_map,
        linear=tuple(linear),
        embeddings=tuple(embeddings),
        prefix=str(getattr(meta, "base_model_prefix", "") or ""),
        # a local model by its absolute path: "m", "./m" and /abs/m share one cached profile
        profile_id=src.id if src.kind == "hub" else str(Path(src.id).resolve()),
        profile_rev=src.revision,
        hf_config=hf_config,
    )


def resolve_model(
    source: str | Path | ResolvedModel,
    revision: str | None = None,
    token: str | None = None,
) -> ResolvedModel:
    """`source` resolved (resolve_source) and described (describe_model): the one resolution
    of a run. A ResolvedModel is returned as it is."""
    if isinstance(source, ResolvedModel):
        return source
    return describe_model(resolve_source(source, revision, token))


# ---------------------------------------------------------------------------------------------
# Resolving a source
# ---------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Where converted GGUF checkpoints are kept (one conversion per file version)."""
    return Path.home() / ".cache" / "higgs" / "gguf"


def resolve_source(
    source: str | Path,
    revision: str | None = None,
    token: str | None = None,
    *,
    cache_dir: Path | None = None,
    hub_cache_dir: Path | None = None,
    local_files_only: bool = False,
) -> ResolvedSource:
    """Find the checkpoint `source` names: a local directory, a .gguf file, or a Hub id.

    Hub ids go through huggingface_hub.snapshot_download (which honours HF_HUB_OFFLINE and its
    cache); `revision` and `token` are passed through and the snapshot's commit sha is returned.
    `cache_dir` holds converted GGUF checkpoints (default ~/.cache/higgs/gguf).
    """
    text = str(source)
    if not text.strip():
        raise ModelNotFoundError("model source is empty")
    path = Path(text).expanduser()
    if path.exists():
        return _resolve_local(path, text, cache_dir)
    looks_local = text.startswith((".", "/", "~")) or "\\" in text or text.count("/") > 1
    if looks_local or not _HUB_ID.match(text):
        raise ModelNotFoundError(f"model path {text!r} does not exist")
    return _resolve_hub(text, revision, token, hub_cache_dir, local_files_only)


def _resolve_local(path: Path, text: str, cache_dir: Path | None) -> ResolvedSource:
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ResolvedSource(convert_gguf(path, cache_dir), text, None, "gguf")
        raise UnsupportedModelError(
            f"{text!r} is a file; give a checkpoint directory (config.json + *.safetensors) "
            "or a .gguf file"
        )
    if not path.is_dir():
        raise ModelNotFoundError(f"model path {text!r} is not a directory")
    has_config = (path / "config.json").is_file()
    has_st = any(path.glob("*.safetensors"))
    ggufs = sorted(path.glob("*.gguf"))
    if has_config and has_st:
        return ResolvedSource(path, text, None, "local")
    if ggufs and not has_st:
        if len(ggufs) > 1:
            names = ", ".join(g.name for g in ggufs)
            raise UnsupportedModelError(f"{text!r} holds several GGUF files ({names}); name one")
        return ResolvedSource(convert_gguf(ggufs[0], cache_dir), text, None, "gguf")
    if not has_config:
        raise ModelNotFoundError(
            f"{text!r} has no config.json; it is not a Hugging Face checkpoint"
        )
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise UnsupportedModelError(
            f"{text!r} holds only PyTorch pickle weights (*.bin); convert it to safetensors first"
        )
    raise ModelNotFoundError(f"{text!r} has no *.safetensors weights")


def _resolve_hub(
    repo_id: str,
    revision: str | None,
    token: str | None,
    hub_cache_dir: Path | None,
    local_files_only: bool,
) -> ResolvedSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        snap = snapshot_download(
            repo_id,
            revision=revision,
            token=token,
            cache_dir=str(hub_cache_dir) if hub_cache_dir else None,
            allow_patterns=_HUB_PATTERNS,
            local_files_only=local_files_only,
        )
    except RevisionNotFoundError as exc:
        raise ModelNotFoundError(
            f"revision {revision!r} of {repo_id!r} not found on the Hub"
        ) from exc
    except GatedRepoError as exc:
        raise ModelNotFoundError(f"{repo_id!r} is gated; a token with access is needed") from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(
            f"model {repo_id!r} is neither a local directory nor a Hub repository"
        ) from exc
    except LocalEntryNotFoundError as exc:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local directory and is not in the Hugging Face cache "
            "(offline, or the Hub cannot be reached)"
        ) from exc
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot fetch {repo_id!r} from the Hub: {exc}") from exc
    snap_path = Path(snap)
    # The cache keeps each snapshot in .../snapshots/<commit sha>/: that name is the revision
    # actually read, whatever branch or tag was asked for.
    sha = snap_path.name if _SHA.match(snap_path.name) else revision
    if not (snap_path / "config.json").is_file() or not any(snap_path.glob("*.safetensors")):
        raise UnsupportedModelError(
            f"Hub repository {repo_id!r} has no config.json + *.safetensors checkpoint"
        )
    return ResolvedSource(snap_path, repo_id, sha, "hub")


def convert_gguf(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Convert a GGUF file once into a safetensors checkpoint (+ tokenizer) and return its dir.

    transformers dequantizes GGUF weights while loading, but refuses `save_pretrained` on such a
    model, so the model is rebuilt from its config without `quantization_config` and the state
    dict copied over. The result is cached by file path, size and mtime.
    """
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = cache_dir if cache_dir is not None else default_cache_dir()
    dest = root / f"{gguf_path.stem}-{key}"
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        _convert_gguf_into(gguf_path, tmp)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _convert_gguf_into(gguf_path: Path, dest: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = str(gguf_path.parent), gguf_path.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=f)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise UnsupportedModelError(f"cannot load GGUF file {str(gguf_path)!r}: {exc}") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)  # type: ignore[no-untyped-call]
    model.load_state_dict(loaded.state_dict())
    del loaded
    dest.mkdir(parents=True)
    model.save_pretrained(str(dest), safe_serialization=True)
    del model
    try:
        AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(str(dest))
    except (
        ValueError,
        KeyError,
        OSError,
    ) as exc:  # a model without a usable tokenizer still quantizes
        (dest / "TOKENIZER_MISSING.txt").write_text(f"tokenizer conversion failed: {exc}\n")


def tokenizer_files(path: Path) -> list[Path]:
    """The tokenizer / generation files of a checkpoint directory, to copy into artifacts."""
    names = set(_TOKENIZER_FILES) | {"generation_config.json"}
    return sorted(p for p in path.iterdir() if p.is_file() and p.name in names)


# ---------------------------------------------------------------------------------------------
# Reading tensors
# ---------------------------------------------------------------------------------------------
