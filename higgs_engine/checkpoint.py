"""Checkpoint input: resolve a model reference, read safetensors tensor by tensor, and find the
quantizable layers from the model's own module structure.

Memory: nothing here loads a whole model. `CheckpointReader` parses the safetensors headers
and reads one tensor at a time into its own buffer with a plain file read (no memory map, see
its docstring); the module structure comes from building the model on the
meta device. The one exception is GGUF, which transformers can only load whole: it is converted
once into a cached safetensors checkpoint, and everything downstream reads that.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import io
import json
import math
import os
import re
import shutil
import struct
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from higgs_engine.errors import (
    CorruptCheckpointError,
    HiggsError,
    ModelNotFoundError,
    UnsupportedModelError,
)

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

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
    model = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
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

_ST_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip
_ST_TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
    "U64": "uint64",
}  # fmt: skip


class CheckpointReader:
    """Tensor-by-tensor access to a directory of (possibly sharded) safetensors files.

    The safetensors headers are parsed here and each tensor is read with a plain file read into
    its own buffer. No memory map: pages of a mapped file stay resident (and count in RSS) once
    touched, so streaming a 2 GB checkpoint through mmap would look like loading all of it.
    Use as a context manager (or call close()) to release the file handles.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        files = self._files()
        self._handles: dict[str, io.FileIO] = {}
        self._where: dict[str, str] = {}
        # key -> (safetensors dtype, shape, absolute start, absolute end)
        self._info: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        try:
            for name in files:
                self._open(name)
        except BaseException:
            self.close()
            raise

    def _open(self, name: str) -> None:
        fp = self.path / name
        f = open(fp, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        self._handles[name] = f
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise CorruptCheckpointError(f"safetensors file {str(fp)!r} is truncated (no header)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > min(size - 8, 256 << 20):
            raise CorruptCheckpointError(
                f"safetensors file {str(fp)!r} has an invalid header length {hlen}"
            )
        try:
            header = json.loads(f.read(hlen))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(
                f"safetensors file {str(fp)!r} has a corrupt header: {exc}"
            ) from exc
        base = 8 + hlen
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype = str(entry["dtype"])
                shape = tuple(int(d) for d in entry["shape"])
                start, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CorruptCheckpointError(
                    f"safetensors file {str(fp)!r}: bad entry for tensor {key!r}"
                ) from exc
            numel = math.prod(shape)
            if dtype not in _ST_DTYPE_BYTES or end - start != numel * _ST_DTYPE_BYTES[dtype]:
                raise CorruptCheckpointError(
                    f"safetensors file {str(fp)!r}: tensor {key!r} has dtype {dtype} shape "
                    f"{list(shape)} but {end - start} bytes"
                )
            if start < 0 or base + end > size:
                raise CorruptCheckpointError(
                    f"safetensors file {str(fp)!r} is truncated: tensor {key!r} ends at byte "
                    f"{base + end} of {size}"
                )
            if key in self._where:
                raise CorruptCheckpointError(
                    f"tensor {key!r} appears in both {self._where[key]!r} and {name!r}"
                )
            self._where[key] = name
            self._info[key] = (dtype, shape, base + start, base + end)

    def _files(self) -> list[str]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CorruptCheckpointError(
                    f"invalid safetensors index {str(index)!r}: {exc}"
                ) from exc
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise CorruptCheckpointError(
                    f"shards listed in {index.name} are missing: {missing}"
                )
            return files
        if (self.path / "model.safetensors").is_file():
            return ["model.safetensors"]
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"no *.safetensors files in {str(self.path)!r}")
        return files

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()

    def keys(self) -> list[str]:
        return list(self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._where))

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        return self._info[key][1]

    def numel(self, key: str) -> int:
        return math.prod(self._info[key][1])

    def nbytes(self, key: str) -> int:
        return self._info[key][3] - self._info[key][2]

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self._where)

    def get(self, key: str) -> torch.Tensor:
        """Read one tensor into fresh memory (nothing stays mapped)."""
        import torch

        if key not in self._where:
            raise KeyError(key)
        dtype, shape, start, end = self._info[key]
        tdtype = getattr(torch, _ST_TORCH_DTYPES[dtype])
        if end == start:
            return torch.empty(shape, dtype=tdtype)
        buf = bytearray(end - start)
        view = memoryview(buf)
        f = self._handles[self._where[key]]
        f.seek(start)
        got = 0
        while got < len(buf):
            n = f.readinto(view[got:])
            if not n:
                raise CorruptCheckpointError(
                    f"cannot read tensor {key!r} from {self._where[key]!r}: file ends early"
                )
            got += n
        return torch.frombuffer(buf, dtype=tdtype).reshape(shape)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self._where:
            yield key, self.get(key)


# ---------------------------------------------------------------------------------------------
# Config, module structure, quantizable layers
# ---------------------------------------------------------------------------------------------


def load_config(path: Path) -> PretrainedConfig:
    """The checkpoint's transformers config, without any quantization_config it may carry."""
    from transformers import AutoConfig

    cfg_file = Path(path) / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except FileNotFoundError as exc:
        raise ModelNotFoundError(f"no config.json in {str(path)!r}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{str(cfg_file)!r} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise UnsupportedModelError(f"{str(cfg_file)!r} has no model_type")
    raw.pop("quantization_config", None)
    model_type = raw.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError) as exc:
        # transformers appends every model type it knows (thousands of characters): not those.
        why = str(exc).split(" Should contain one of")[0].strip()
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by transformers: {why}"
        ) from exc


def model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The transformers class named by config.architectures, else the causal-LM auto class."""
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, str(arch), None)
        if isinstance(cls, type):
            return cls
    from transformers import AutoModel, AutoModelForCausalLM

    for auto in (AutoModelForCausalLM, AutoModel):
        mapping = auto._model_mapping
        if type(config) in mapping:
            found: type[nn.Module] = mapping[type(config)]  # type: ignore[assignment]
            return found
    raise UnsupportedModelError(
        f"transformers has no model class for model_type {config.model_type!r}"
    )


def build_meta_model(config: PretrainedConfig) -> nn.Module:
    """The model's module tree on the meta device: structure and shapes, no memory."""
    import torch

    cls = model_class(config)
    try:
        with torch.device("meta"):
            model = cls._from_config(config)  # type: ignore[attr-defined]
    except HiggsError:
        raise
    except Exception as exc:  # transformers raises many types for configs it cannot build
        raise UnsupportedModelError(
            f"cannot build {cls.__name__} from the checkpoint config: {exc}"
        ) from exc
    return model


@dataclass(frozen=True)
class LayerSpec:
    """One linear layer of the checkpoint, as the quantizer sees it (W is out x in)."""

    name: str  # module name, e.g. "model.layers.0.mlp.down_proj"
    key: str  # checkpoint tensor key of its weight
    out_features: int
    in_features: int
    transposed: bool  # True for GPT-2's Conv1D, whose stored weight is (in, out)
    bias_key: str | None

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features

    def weight(self, reader: CheckpointReader) -> torch.Tensor:
        """The layer's weight as a float32 (out, in) tensor."""
        import torch

        w = reader.get(self.key)
        if self.transposed:
            w = w.t()
        return w.to(torch.float32).contiguous()


def _linear_modules(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    out_emb = None
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        out_emb = get_out()
    emb_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    found = []
    for name, mod in model.named_modules():
        if mod is out_emb or not name:
            continue
        if isinstance(mod, nn.Linear):
            transposed = False
        elif isinstance(mod, Conv1D):
            transposed = True
        else:
            continue
        # A weight shared with an embedding (tied head under another name) stays 16-bit.
        if id(mod.weight) in emb_weights:
            continue
        found.append((name, mod, transposed))
    return found


def match_key(key: str, keys: set[str], prefix: str) -> str | None:
    """The name in `keys` that a stored tensor name stands for (checkpoints may omit, or add,
    the base-model prefix such as "model"), or None."""
    if key in keys:
        return key
    if prefix and key.startswith(prefix + "."):
        stripped = key[len(prefix) + 1 :]
        if stripped in keys:
            return stripped
    if prefix and f"{prefix}.{key}" in keys:
        return f"{prefix}.{key}"
    return None


def layer_specs(
    config: PretrainedConfig,
    checkpoint_keys: Sequence[str] | None = None,
    *,
    model: nn.Module | None = None,
) -> list[LayerSpec]:
    """Every candidate linear layer (nn.Linear / Conv1D, not the output head nor embeddings).

    With `checkpoint_keys`, each spec's `key` is matched to the stored tensor name (checkpoints
    saved without the base-model prefix are handled) and a missing weight is an error.
    """
    model = model if model is not None else build_meta_model(config)
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    keys = set(checkpoint_keys) if checkpoint_keys is not None else None
    specs = []
    for name, mod, transposed in _linear_modules(model):
        w: torch.Tensor = mod.weight  # type: ignore[assignment]
        out_f, in_f = (
            (int(w.shape[1]), int(w.shape[0])) if transposed else (int(w.shape[0]), int(w.shape[1]))
        )
        key = f"{name}.weight"
        bias = getattr(mod, "bias", None)
        bias_key: str | None = f"{name}.bias" if bias is not None else None
        if keys is not None:
            matched = match_key(key, keys, prefix)
            if matched is None:
                raise CorruptCheckpointError(f"checkpoint has no tensor for layer weight {key!r}")
            key = matched
            if bias_key is not None:
                bias_key = match_key(bias_key, keys, prefix)
        specs.append(LayerSpec(name, key, out_f, in_f, transposed, bias_key))
    if not specs:
        raise UnsupportedModelError(f"{type(model).__name__} has no linear layers to quantize")
    return specs


def is_skipped(name: str, skip: Sequence[str]) -> bool:
    """True when a module name matches one of the fnmatch patterns in `skip`."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in skip)


def quantizable_layers(
    config: PretrainedConfig | Path | str, skip: Sequence[str] = ()
) -> list[str]:
    """Module names of the layers to quantize: every nn.Linear (and GPT-2 Conv1D) except the
    output head and embeddings, minus those matching a `skip` pattern (fnmatch)."""
    if isinstance(config, str | Path):
        config = load_config(Path(config))
    return [s.name for s in layer_specs(config) if not is_skipped(s.name, skip)]
