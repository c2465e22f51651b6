"""Artifacts: writing the `native` and `dequantized` checkpoints, and loading any model.

native/
  model.safetensors   per quantized layer `<module>.higgs.<tensor>` (packed codes, fp16 scales,
                      ... as QuantizedMatrix.to_tensors() names them), one `higgs.grid.p<P>.n<N>`
                      float32 (n, p) tensor per grid used, every other tensor (norms, embeddings,
                      head, biases, layers kept unquantized) under its own name in 16 bits.
                      With scope "all" the token embedding (layer entry "role": "embedding",
                      loaded as HiggsEmbedding; a tied head computes from the same codes) and
                      an untied head ("role": "head", a HiggsLinear) are quantized layers too
  config.json         the source config + "quantization_config": {"quant_method": "higgs", ...}
  tokenizer files     copied from the source
dequantized/
  model.safetensors   an ordinary 16-bit checkpoint of the quantized weights (stock transformers)
  config.json, tokenizer files

Both safetensors files are written by a streaming writer (one tensor in memory at a time) with
tensors ordered by name, so the same content always gives the same bytes. Each format is a
FormatWriter of higgs_engine.formats; ArtifactWriter fans a run's tensors out to the formats
its config names.

A sharded source (a model.safetensors.index.json) gives sharded artifacts instead, assembled
from parts (higgs_engine.parts): model-0000i-of-0000N.safetensors + model.safetensors.index.json
in each format, as transformers writes large models; load_model / load_native read both.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from higgs_engine.errors import (
    CorruptCheckpointError,
    InvalidConfigError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from higgs_engine.formats import FormatWriter, format_writer
from higgs_engine.formats.base import ST_METADATA as _ST_METADATA
from higgs_engine.formats.base import WEIGHTS_NAME, torch_dtype, write_configs
from higgs_engine.formats.base import read_config_json as _raw_config
from higgs_engine.formats.base import write_json as _write_json
from higgs_engine.formats.native import (
    FORMAT_VERSION,
    QUANT_METHOD,
    grid_key,
    quantization_config,
)
from higgs_engine.model_loading import model_key, params_on_meta
from higgs_engine.model_structure import (
    LayerSpec,
    build_meta_model,
    load_config,
    model_class,
)
from higgs_engine.planning.config import WRITER_FORMATS
from higgs_engine.safetensors_stream import (
    SHARD_INDEX,
    StreamingSafetensorsWriter,
    read_weight_map,
)
from higgs_engine.sources import resolve_source, tokenizer_files

if TYPE_CHECKING:
    import torch
    from torch import nn

    from higgs_engine.quantize import QuantizedMatrix

__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "WEIGHTS_NAME",
    "ArtifactWriter",
    "artifact_kind",
    "find_model_dir",
    "grid_key",
    "load_model",
    "load_native",
    "quantization_config",
    "save_native",
    "torch_dtype",
    "write_configs",
]


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    spec: LayerSpec
    meta: dict[str, Any]


@dataclass
class ArtifactWriter:
    """Streams a quantized checkpoint into `root/<format>` for every format in `formats`: the
    format-agnostic fan-out over the writers of higgs_engine.formats.FORMATS.

    Call `add_plain` for every tensor that is not quantized (cast to `dtype` when floating),
    `add_quantized` for every quantized layer, then `finish()` (or `abort()`). The writer keeps
    the run's record (layers, grids, layers kept 16-bit, the native artifact's bytes) whichever
    formats are written.
    """

    root: Path
    formats: Sequence[str]
    dtype: str
    source_dir: Path
    engine_config: dict[str, Any]
    native_bytes: int = 0  # tensor bytes of the native artifact, whether or not it is written
    # False for one part of a sharded run: the grids go to a shard of their own at assembly.
    grids_in_native: bool = True
    _writers: dict[str, FormatWriter] = field(default_factory=dict)
    _layers: dict[str, _Entry] = field(default_factory=dict)
    _grids: dict[tuple[int, int], int] = field(default_factory=dict)  # (p, n) -> bytes
    _kept: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        classes = [format_writer(fmt) for fmt in self.formats]
        for fmt, cls in zip(self.formats, classes, strict=True):
            self._writers[fmt] = cls(self.root / fmt, self.dtype, self.source_dir)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(torch_dtype(self.dtype)) if t.is_floating_point() else t

    def add_plain(self, key: str, tensor: torch.Tensor) -> int:
        """Write a non-quantized tensor to every format; returns its bytes in the artifact."""
        t = self._cast(tensor)
        for w in self._writers.values():
            w.add_plain(key, t)
        nbytes = t.numel() * t.element_size()
        self.native_bytes += nbytes
        return nbytes

    def keep_layer(self, name: str) -> None:
        """Record that linear layer `name` stays 16-bit (its weight goes through add_plain)."""
        self._kept.append(name)

    def add_quantized(
        self,
        spec: LayerSpec,
        q: QuantizedMatrix | None,
        w_hat: torch.Tensor,
        bits: float | None = None,
    ) -> int:
        """Write one quantized layer to every format: its native encoding `q` and W_hat
        (out, in) float32. Returns the layer's bytes in the native artifact (its grid is
        counted once, apart).

        A method without a native encoding gives q=None and its `bits` per weight: the layer
        counts bits * numel / 8 bytes (rounded up), and only formats that need no codes (not
        `native`) can take it.
        """
        import torch

        from higgs_engine.grids import get_grid

        if q is None:
            if bits is None:
                raise InvalidConfigError(
                    f"layer {spec.name!r} has no native encoding and no bits per weight"
                )
            for w in self._writers.values():
                w.add_quantized(spec, None, w_hat)
            nbytes = math.ceil(bits * spec.numel / 8)
            self.native_bytes += nbytes
            return nbytes
        tensors = q.to_tensors()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        for w in self._writers.values():
            w.add_quantized(spec, q, w_hat)
        gk = (int(q.p), int(q.n))
        if gk not in self._grids:
            grid = get_grid(*gk).to(torch.float32).contiguous()
            self._grids[gk] = grid.numel() * grid.element_size()
            if self.grids_in_native:
                for w in self._writers.values():
                    if w.carries_grids:
                        w.add_plain(grid_key(*gk), grid)
            self.native_bytes += self._grids[gk]
        self._layers[spec.name] = _Entry(spec, q.meta())
        self.native_bytes += nbytes
        return nbytes

    @property
    def grid_bytes(self) -> int:
        return sum(self._grids.values())

    def layers_config(self) -> dict[str, dict[str, Any]]:
        """The quantization_config "layers" entries of the layers written so far."""
        return {
            name: {
                **e.meta,
                "weight_key": e.spec.key,
                "bias_key": e.spec.bias_key,
                "transposed": e.spec.transposed,
                # the token embedding and an output head (scope "all"); linear layers say nothing
                **({"role": e.spec.role} if e.spec.role != "linear" else {}),
            }
            for name, e in self._layers.items()
        }

    @property
    def grids_used(self) -> list[tuple[int, int]]:
        return sorted(self._grids)

    @property
    def kept_layers(self) -> list[str]:
        return sorted(self._kept)

    def tensor_names(self, fmt: str) -> list[str]:
        """Names of the tensors written to format `fmt`, sorted (the file's order)."""
        return self._writers[fmt].tensor_names()

    def quantization_config(self) -> dict[str, Any]:
        return quantization_config(
            self.dtype, self.engine_config, self._grids, self.layers_config(), self._kept
        )

    def finish_part(self) -> dict[str, int]:
        """Close the weight files of one part of a sharded run (no configs, no tokenizer files:
        the assembly writes those). Returns each format's tensor bytes."""
        return {fmt: w.finish_part() for fmt, w in self._writers.items()}

    def finish(self) -> dict[str, dict[str, int]]:
        """Close the weight files and write configs + tokenizer files. Returns file sizes."""
        qc = self.quantization_config()
        for w in self._writers.values():
            w.finish(qc)
        return {
            fmt: {p.name: p.stat().st_size for p in sorted((self.root / fmt).iterdir())}
            for fmt in self._writers
        }

    def abort(self) -> None:
        for w in self._writers.values():
            w.abort()


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def artifact_kind(path: Path) -> str | None:
    """ "native" for a HIGGS native artifact, "plain" for any other HF checkpoint dir, else None."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return None
    raw = _raw_config(path)
    qc = raw.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD and "layers" in qc:
        return "native"
    return "plain"


def find_model_dir(path: Path) -> tuple[Path, str]:
    """(directory, kind) for a model dir, an artifact, or a `quantize` output dir.

    An output dir holding both artifacts resolves to `native`, the real quantized model.
    """
    kind = artifact_kind(path)
    if kind is not None:
        return path, kind
    for sub in WRITER_FORMATS:  # native first: the real quantized model
        kind = artifact_kind(path / sub)
        if kind is not None:
            return path / sub, kind
    raise ModelNotFoundError(
        f"{str(path)!r} is not a checkpoint, an artifact, or a quantize output directory"
    )


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    cache_dir: Path | None = None,
) -> tuple[nn.Module, Any]:
    """Load a plain checkpoint, a native or a dequantized artifact: (model in eval mode, tokenizer
    or None). Native artifacts come back with HiggsLinear layers that compute from the codes.

    `dtype` defaults to the checkpoint's own; quantized tensors always keep theirs.
    """
    p = Path(str(path)).expanduser()
    if p.is_dir():
        model_dir, kind = find_model_dir(p)
    else:
        # a Hub id or a .gguf file: resolve (and convert) like the quantizer does
        model_dir, kind = resolve_source(str(path), cache_dir=cache_dir).path, "plain"
    if kind == "native":
        model = load_native(model_dir, dtype=dtype)
    else:
        model = _load_plain(model_dir, dtype)
    model.to(device)
    model.eval()
    return model, _load_tokenizer(model_dir)


def _load_tokenizer(path: Path) -> Any:
    if not tokenizer_files(path) or not any(
        f.name.startswith(("tokenizer", "vocab")) for f in tokenizer_files(path)
    ):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise CorruptCheckpointError(f"cannot load the tokenizer in {str(path)!r}: {exc}") from exc


def _load_plain(path: Path, dtype: torch.dtype | None) -> nn.Module:
    config = load_config(path)
    cls = model_class(config)
    try:
        model = cls.from_pretrained(str(path), dtype=dtype if dtype is not None else "auto")  # type: ignore[attr-defined]
    except (OSError, ValueError, RuntimeError) as exc:
        raise CorruptCheckpointError(f"cannot load the checkpoint in {str(path)!r}: {exc}") from exc
    return cast("nn.Module", model)


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


class _WeightFiles:
    """The weights of an artifact: model.safetensors, or the shards its SHARD_INDEX lists."""

    def __init__(self, path: Path) -> None:
        from safetensors import SafetensorError, safe_open

        weight_map = read_weight_map(path)
        names = [WEIGHTS_NAME] if weight_map is None else sorted(set(weight_map.values()))
        self.describe = str(path / (WEIGHTS_NAME if weight_map is None else SHARD_INDEX))
        self._where: dict[str, Any] = {}
        for name in names:
            try:
                handle = safe_open(str(path / name), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CorruptCheckpointError(f"cannot read {str(path / name)!r}: {exc}") from exc
            for key in handle.keys():  # type: ignore[no-untyped-call]  # noqa: SIM118 - a safetensors handle, not a dict
                if key in self._where:
                    raise CorruptCheckpointError(
                        f"tensor {key!r} appears in more than one shard of {str(path)!r}"
                    )
                if weight_map is not None and weight_map.get(key) != name:
                    raise CorruptCheckpointError(
                        f"tensor {key!r} is in {name!r} but {SHARD_INDEX} says "
                        f"{weight_map.get(key)!r}"
                    )
                self._where[key] = handle

    def keys(self) -> list[str]:
        return list(self._where)

    def get_tensor(self, key: str) -> torch.Tensor:
        return cast("torch.Tensor", self._where[key].get_tensor(key))


def load_native(path: Path, dtype: torch.dtype | None = None) -> nn.Module:
    """Build the model of a native artifact with HiggsLinear layers (on CPU)."""
    from safetensors import SafetensorError

    raw, qc = _native_config(path)
    dtype = dtype or torch_dtype(str(qc.get("dtype", "float16")))
    config = load_config(path)
    build_meta_model(config)  # fail with a clear error if transformers cannot build it
    with params_on_meta():
        model = model_class(config)._from_config(config, dtype=dtype)  # type: ignore[attr-defined]
    handle = _WeightFiles(path)
    try:
        grids = {g: handle.get_tensor(g) for g in qc.get("grids", {}).values()}
        used = set(grids) | _place_quantized(model, handle, qc["layers"], grids, dtype)
        plain, plain_keys = _plain_tensors(model, handle, sorted(set(handle.keys()) - used), dtype)
    except (SafetensorError, KeyError, ValueError, RuntimeError) as exc:
        raise CorruptCheckpointError(
            f"cannot read native artifact {str(handle.describe)!r}: {exc}"
        ) from exc
    quantized_embedding = any(m.get("role") == "embedding" for m in qc["layers"].values())
    _assign_plain(model, plain, quantized_embedding)
    # Kept so that save_native can write the same artifact back.
    model.higgs_artifact = {
        "config": raw,
        "plain_keys": plain_keys,
        "grids": grids,
        "dir": str(path),
    }
    return cast("nn.Module", model)


def _native_config(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, its quantization_config) of a native artifact of this format version."""
    raw = _raw_config(path)
    qc = raw.get("quantization_config") or {}
    if qc.get("quant_method") != QUANT_METHOD:
        raise CorruptCheckpointError(f"{str(path)!r} is not a HIGGS native artifact")
    if qc.get("format_version") != FORMAT_VERSION:
        raise UnsupportedModelError(
            f"native artifact format_version {qc.get('format_version')!r} is not {FORMAT_VERSION}"
        )
    return raw, qc


def _place_quantized(
    model: nn.Module,
    handle: _WeightFiles,
    layers: dict[str, dict[str, Any]],
    grids: dict[str, torch.Tensor],
    dtype: torch.dtype,
) -> set[str]:
    """Put a HiggsLinear (HiggsEmbedding) in `model` for every quantized layer, and a head
    tied to a quantized embedding on its codes; returns the tensor keys read."""
    from higgs_engine.modules import HiggsEmbedding, HiggsLinear
    from higgs_engine.quantize import QuantizedMatrix

    tied_head = _tied_head(model)
    keys = set(handle.keys())
    used: set[str] = set()
    for name, meta in layers.items():
        prefix = f"{name}.higgs."
        tkeys = sorted(k for k in keys if k.startswith(prefix))
        if not tkeys:
            raise CorruptCheckpointError(f"native artifact has no tensors for layer {name!r}")
        tensors = {k[len(prefix) :]: handle.get_tensor(k) for k in tkeys}
        used.update(tkeys)
        qmeta = {k: v for k, v in meta.items() if k not in _ENTRY_KEYS}
        q = QuantizedMatrix.from_tensors(tensors, qmeta)
        grid = grids.get(grid_key(q.p, q.n))
        if grid is None:
            raise CorruptCheckpointError(f"native artifact lacks the grid p={q.p} n={q.n}")
        bias = None
        if meta.get("bias_key"):
            bias = handle.get_tensor(meta["bias_key"]).to(dtype)
            used.add(meta["bias_key"])
        if meta.get("role") == "embedding":
            _set_module(model, name, HiggsEmbedding(q, grid, dtype))
            if tied_head is not None:
                # the head tied to the embedding computes with the same codes and scales
                _set_module(model, tied_head, HiggsLinear(q, None, grid, tied_to=name))
        else:
            _set_module(model, name, HiggsLinear(q, bias, grid))
    return used


def _plain_tensors(
    model: nn.Module, handle: _WeightFiles, keys: list[str], dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], list[tuple[str, str]]]:
    """The tensors stored unquantized, by the model's key (floating ones cast to `dtype`), and
    (stored key, model key) of each."""
    model_sd_keys = set(model.state_dict().keys())
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    plain: dict[str, torch.Tensor] = {}
    plain_keys: list[tuple[str, str]] = []
    for k in keys:
        mk = model_key(k, model_sd_keys, prefix)
        t = handle.get_tensor(k)
        plain[mk] = t.to(dtype) if t.is_floating_point() else t
        plain_keys.append((k, mk))
    return plain, plain_keys


def _assign_plain(
    model: nn.Module, plain: dict[str, torch.Tensor], quantized_embedding: bool
) -> None:
    """Assign the plain tensors to `model`, tie its head, and check nothing is left on meta."""
    result = model.load_state_dict(plain, strict=False, assign=True)
    # Checkpoints written by older transformers keep non-persistent buffers the model now builds
    # itself (BERT's embeddings.position_ids): not an error, the model's own buffer is used.
    buffers = {n for n, _ in model.named_buffers()}
    unexpected = sorted(k for k in result.unexpected_keys if k not in buffers)
    if unexpected:
        raise CorruptCheckpointError(
            f"native artifact has tensors the model does not: {unexpected[:5]}"
        )
    # Tied heads are stored once (as the embedding); re-tie after assigning real tensors. A
    # quantized embedding has no dense weight to tie to: its tied head was rebuilt above.
    if not quantized_embedding:
        cast("Any", model).tie_weights()
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise CorruptCheckpointError(f"native artifact lacks tensors for {still_meta[:5]}")


# A quantization_config layer entry's keys that are not the QuantizedMatrix's meta.
_ENTRY_KEYS = ("weight_key", "bias_key", "transposed", "role")


def _tied_head(model: nn.Module) -> str | None:
    """The module name of an output head that shares the token embedding's weight, else None."""
    get_in: Any = getattr(model, "get_input_embeddings", None)
    get_out: Any = getattr(model, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    w = getattr(emb, "weight", None)
    if head is None or w is None or getattr(head, "weight", None) is not w:
        return None
    return next((n for n, m in model.named_modules() if m is head and n), None)


def save_native(model: nn.Module, out_dir: Path) -> Path:
    """Write a model loaded by `load_native` back as a native artifact (same bytes)."""

    from higgs_engine.modules import HiggsEmbedding, HiggsLinear

    info = getattr(model, "higgs_artifact", None)
    if info is None:
        raise UnsupportedModelError("save_native needs a model loaded from a native artifact")
    raw = info["config"]
    qc = raw["quantization_config"]
    store = torch_dtype(str(qc.get("dtype", "float16")))
    out_dir.mkdir(parents=True, exist_ok=False)
    writer = StreamingSafetensorsWriter(out_dir / WEIGHTS_NAME, _ST_METADATA)
    try:
        sd = model.state_dict()
        for file_key, model_key in info["plain_keys"]:
            t = sd[model_key]
            writer.add(file_key, t.to(store) if t.is_floating_point() else t)
        for gname, g in info["grids"].items():
            writer.add(gname, g)
        for name, mod in model.named_modules():
            if isinstance(mod, HiggsEmbedding) or (
                isinstance(mod, HiggsLinear) and mod.tied_to is not None
            ):
                if isinstance(mod, HiggsEmbedding):
                    for tname, t in mod.quantized.to_tensors().items():
                        writer.add(f"{name}.higgs.{tname}", t)
                continue  # a tied head is stored once, as the embedding
            if isinstance(mod, HiggsLinear):
                for tname, t in mod.quantized.to_tensors().items():
                    writer.add(f"{name}.higgs.{tname}", t)
                bias_key = qc["layers"][name].get("bias_key")
                if bias_key and mod.bias is not None:
                    writer.add(bias_key, mod.bias.detach().to(store))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    _write_json(out_dir / "config.json", raw)
    src = Path(info["dir"])
    for f in tokenizer_files(src):
        shutil.copy2(f, out_dir / f.name)
    return out_dir
