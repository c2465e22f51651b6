"""A checkpoint's config checked against its tensors, before anything is built from it.

A config.json is only a claim: `vocab_size = 2**31 - 1` makes transformers, llama.cpp's
converter or a profile allocate a matrix of that many rows, whatever the checkpoint holds. So
every config field that sizes a tensor is compared here with the shapes in the safetensors
headers (parsed without reading any tensor data), and a field the tensors contradict fails as
CorruptCheckpointError naming it. `check_finite` reads the data, tensor by tensor, for the
paths that hand tensors to native code that aborts on NaN or Inf (llama.cpp).

The checks are pure functions of `Declared` (the config's sizing fields) and the shapes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError

__all__ = [
    "MAX_POSITIONS",
    "SIZE_FIELDS",
    "Declared",
    "check_checkpoint",
    "check_declared",
    "check_finite",
    "check_tensor_finite",
    "check_tokenizer",
    "checkpoint_shapes",
    "declared_sizes",
]

# The config fields (transformers' canonical names; aliases such as GPT-2's n_embd resolve to
# them through the config class) whose values size tensors.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "embedding_size",
)
# A context length beyond any published model (the longest is ~10M tokens): rotary models have
# no tensor to compare it with, and llama.cpp sizes its default context from it.
MAX_POSITIONS = 1 << 24

# Tensor name endings by role.
_EMBED = (
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "tok_embeddings.weight",
    "embed_in.weight",
)
_HEAD = ("lm_head.weight", "embed_out.weight")
_POSITIONS = ("wpe.weight", "position_embeddings.weight", "embed_positions.weight")
_QUERY = ("q_proj.weight", "attention.self.query.weight", "attn.q.weight")
_KEY = ("k_proj.weight", "attention.self.key.weight", "attn.k.weight")
_MLP = ("mlp", "ffn", "feed_forward", "intermediate", "c_fc", "fc1", "fc2")
_LAYER = re.compile(r"^(.*?(?:^|\.)(?:layers|layer|h|blocks|block))\.(\d+)\.")


@dataclass(frozen=True)
class Declared:
    """The config's sizing fields (None: the config has no such field), and whether the model
    is a mixture of experts (whose intermediate_size may size no stored tensor)."""

    sizes: Mapping[str, Any]
    experts: bool = False

    def get(self, name: str) -> Any:
        return self.sizes.get(name)


def declared_sizes(config: Any) -> Declared:
    """The sizing fields of a transformers config (aliases resolved by its class)."""
    sizes: dict[str, Any] = {}
    for name in SIZE_FIELDS:
        try:
            value = getattr(config, name)
        except AttributeError:
            continue
        if value is not None:
            sizes[name] = value
    experts = any(
        getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")
    )
    return Declared(sizes, experts=bool(experts) or "moe" in str(getattr(config, "model_type", "")))


def checkpoint_shapes(path: Path) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """({tensor name: shape} of the shards present, every tensor name the checkpoint lists).

    Only the safetensors headers are read (and checked: lengths, offsets inside the file). A
    sharded checkpoint's index names every tensor even when only some shards are present (a
    Hub model fanned out fetches its shards part by part)."""
    from higgs_engine.safetensors_stream import SHARD_INDEX, CheckpointReader, read_weight_map

    weight_map = read_weight_map(path)
    if weight_map is None:
        with CheckpointReader(path) as reader:
            shapes = {k: reader.shape(k) for k in reader}
        return shapes, sorted(shapes)
    present = sorted({f for f in weight_map.values() if (Path(path) / f).is_file()})
    shapes = {}
    if present:
        with CheckpointReader(path, present) as reader:
            shapes = {k: reader.shape(k) for k in reader}
            listed = set(weight_map)
            stray = sorted(k for k in shapes if k not in listed)
            if stray:
                raise CorruptCheckpointError(
                    f"tensors {stray[:3]} are stored but not listed in {SHARD_INDEX}"
                )
            missing = sorted(k for k, f in weight_map.items() if f in present and k not in shapes)
            if missing:
                raise CorruptCheckpointError(
                    f"{SHARD_INDEX} lists tensors {missing[:3]} that their shards do not hold"
                )
    return shapes, sorted(weight_map)


def check_checkpoint(path: Path, config: Any) -> None:
    """Check the checkpoint at `path` against its transformers `config` (headers only), and
    its tokenizer.json against the vocabulary."""
    shapes, names = checkpoint_shapes(path)
    declared = declared_sizes(config)
    check_declared(declared, shapes, names)
    vocab = declared.get("vocab_size")
    tok = Path(path) / "tokenizer.json"
    if vocab is not None and tok.is_file():
        check_tokenizer(tok.read_bytes(), vocab)


def check_tokenizer(raw: bytes, vocab_size: int) -> None:
    """CorruptCheckpointError when a tokenizer.json is not JSON or gives a token an id the
    model's embedding has no row for (ids from vocab_size up)."""
    import json

    try:
        tok = json.loads(raw)
        model = tok.get("model") or {}
        vocab = model.get("vocab") or {}
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t.get("id") for t in tok.get("added_tokens") or []]
    except (ValueError, AttributeError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"tokenizer.json is not a tokenizer: {exc}", field="tokenizer.json"
        ) from exc
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or i < 0]
    if bad:
        raise CorruptCheckpointError(
            f"tokenizer.json has invalid token ids {bad[:3]}", field="tokenizer.json"
        )
    top = max(ids, default=-1)
    if top >= vocab_size:
        raise CorruptCheckpointError(
            f"tokenizer.json has token id {top} but the model's vocab_size is {vocab_size}",
            field="tokenizer.json",
        )


def check_declared(
    declared: Declared, shapes: Mapping[str, tuple[int, ...]], names: list[str]
) -> None:
    """CorruptCheckpointError (naming the field) when a sizing field is not a positive integer
    or disagrees with the tensors: `shapes` of the tensors at hand, `names` of every tensor the
    checkpoint lists (some may be in shards not present)."""
    for field, value in declared.sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CorruptCheckpointError(
                f"config.json: {field}={value!r} must be a positive integer", field=field
            )
    _check_layers(declared, names)
    largest = max((max(s) for s in shapes.values() if s), default=0)
    if shapes:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "embedding_size"):
            value = declared.get(field)
            if value is not None and value > largest:
                raise CorruptCheckpointError(
                    f"config.json: {field}={value} is larger than every tensor of the "
                    f"checkpoint (the largest dimension is {largest})",
                    field=field,
                )
    _check_embeddings(declared, shapes)
    _check_attention(declared, shapes)
    _check_mlp(declared, shapes)
    _check_positions(declared, shapes)


def _fail(field: str, value: Any, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"config.json: {field}={value} but {why}", field=field)


def _find(shapes: Mapping[str, tuple[int, ...]], endings: tuple[str, ...]) -> list[str]:
    return sorted(k for k, s in shapes.items() if len(s) == 2 and k.endswith(endings))


def _check_layers(declared: Declared, names: list[str]) -> None:
    layers = declared.get("num_hidden_layers")
    if layers is None:
        return
    stacks: dict[str, set[int]] = {}
    for name in names:
        m = _LAYER.match(name)
        if m is not None:
            stacks.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not stacks:
        # No per-layer names this check knows: a layer holds at least one tensor.
        if layers > len(names):
            raise _fail("num_hidden_layers", layers, f"the checkpoint has {len(names)} tensors")
        return
    counts = {prefix: max(idx) + 1 for prefix, idx in stacks.items()}
    if layers not in counts.values():
        found = ", ".join(f"{p}.0-{n - 1}" for p, n in sorted(counts.items()))
        raise _fail("num_hidden_layers", layers, f"the checkpoint's layers are {found}")
    for prefix, idx in stacks.items():
        if counts[prefix] == layers and len(idx) != layers:
            gone = sorted(set(range(layers)) - idx)[:5]
            raise _fail("num_hidden_layers", layers, f"layers {gone} of {prefix} are missing")


def _check_embeddings(declared: Declared, shapes: Mapping[str, tuple[int, ...]]) -> None:
    vocab, hidden = declared.get("vocab_size"), declared.get("hidden_size")
    width = declared.get("embedding_size") or hidden
    for name in _find(shapes, _EMBED):
        rows, cols = shapes[name]
        if vocab is not None and rows != vocab:
            raise _fail("vocab_size", vocab, f"{name} has {rows} rows")
        if width is not None and cols not in (width, hidden):
            field = "embedding_size" if declared.get("embedding_size") else "hidden_size"
            raise _fail(field, width, f"{name} has {cols} columns")
    for name in _find(shapes, _HEAD):
        rows, _ = shapes[name]
        if vocab is not None and rows != vocab:
            raise _fail("vocab_size", vocab, f"{name} has {rows} rows")


def _check_attention(declared: Declared, shapes: Mapping[str, tuple[int, ...]]) -> None:
    hidden, heads = declared.get("hidden_size"), declared.get("num_attention_heads")
    if hidden is None or heads is None:
        return
    if heads > hidden:
        raise _fail("num_attention_heads", heads, f"hidden_size is {hidden}")
    head_dim = declared.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise _fail("num_attention_heads", heads, f"it does not divide hidden_size={hidden}")
        head_dim = hidden // heads
    kv = declared.get("num_key_value_heads") or heads
    if kv > heads:
        raise _fail("num_key_value_heads", kv, f"num_attention_heads is {heads}")
    for name in _find(shapes, _QUERY):
        rows = shapes[name][0]
        if rows != heads * head_dim:
            field = "head_dim" if declared.get("head_dim") else "num_attention_heads"
            raise _fail(field, declared.get(field), f"{name} has {rows} rows ({heads} heads)")
    for name in _find(shapes, _KEY):
        rows = shapes[name][0]
        if rows != kv * head_dim:
            raise _fail(
                "num_key_value_heads",
                kv,
                f"{name} has {rows} rows (num_attention_heads={heads}, head_dim {head_dim})",
            )


def _check_mlp(declared: Declared, shapes: Mapping[str, tuple[int, ...]]) -> None:
    inter = declared.get("intermediate_size")
    if inter is None or declared.experts:
        return
    dims: set[int] = set()
    first = None
    for name in sorted(shapes):
        m = _LAYER.match(name)
        if m is None or len(shapes[name]) != 2 or not name.endswith(".weight"):
            continue
        key = (m.group(1), m.group(2))
        first = first or key
        rest = name[m.end() :]
        if key == first and any(part in rest for part in _MLP):
            dims.update(shapes[name])
    # A fused gate+up projection holds 2 x intermediate_size rows.
    if dims and inter not in dims and 2 * inter not in dims:
        raise _fail(
            "intermediate_size", inter, f"the first layer's MLP tensors have sizes {sorted(dims)}"
        )


def _check_positions(declared: Declared, shapes: Mapping[str, tuple[int, ...]]) -> None:
    positions = declared.get("max_position_embeddings")
    if positions is None:
        return
    if positions > MAX_POSITIONS:
        raise _fail(
            "max_position_embeddings", positions, f"the most this service takes is {MAX_POSITIONS}"
        )
    for name in _find(shapes, _POSITIONS):
        rows = shapes[name][0]
        # OPT's learned positions carry 2 extra rows; fewer rows than declared cannot work.
        if rows < positions or rows > positions + 2:
            raise _fail("max_position_embeddings", positions, f"{name} has {rows} rows")


def check_finite(path: Path) -> None:
    """InvalidConfigError naming the first floating-point tensor of the checkpoint at `path`
    holding NaN or Inf (read one tensor at a time), the check every path makes before native
    code (llama.cpp's quantizer) sees the weights."""
    from higgs_engine.safetensors_stream import CheckpointReader

    with CheckpointReader(path) as reader:
        for name in sorted(reader.keys()):
            check_tensor_finite(name, reader.get(name))


def check_tensor_finite(name: str, t: Any) -> None:
    """InvalidConfigError when the floating-point tensor `t` (named `name`) holds NaN or Inf."""
    import torch

    if not t.is_floating_point():
        return
    if t.element_size() == 1:  # float8: isfinite wants a wider type
        t = t.to(torch.float16)
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise InvalidConfigError(f"tensor {name!r} has {bad} non-finite values (nan or inf)")
