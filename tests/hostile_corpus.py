"""A corpus of hostile checkpoints, each a tiny Llama that llama.cpp's converter takes
(tests.fixtures.build_gguf_llama) with one thing made to lie or break, and the job error code
every format (native, dequantized, gguf) must end with.

`build_corpus(root)` writes every case as root/<case>/ (a models folder the service serves);
HOSTILE[case] is (what is wrong, the expected code, the field or text the message names).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

from tests.fixtures import build_gguf_llama

HIDDEN = 64  # 32-value llama.cpp types fit; small and fast everywhere
FORMATS = ("native", "dequantized", "gguf")


def _config(path: Path, **changes: object) -> None:
    f = path / "config.json"
    cfg = json.loads(f.read_text())
    cfg.update(changes)
    f.write_text(json.dumps(cfg))


def _poison(path: Path, key: str, value: float) -> None:
    """Set the first element of tensor `key` to `value` (NaN / Inf), in place on disk."""
    import torch
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    tensors = load_file(str(f))
    t = tensors[key].clone()
    t.view(-1)[0] = value
    tensors[key] = t.to(torch.bfloat16) if t.dtype == torch.bfloat16 else t
    save_file(tensors, str(f), metadata={"format": "pt"})


def _huge_header(path: Path) -> None:
    """A header that declares a tensor of 2^40 elements whose bytes the file does not hold."""
    f = path / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["model.embed_tokens.weight"]["shape"] = [1 << 20, 1 << 20]
    end = header["model.embed_tokens.weight"]["data_offsets"][0] + (1 << 41)
    header["model.embed_tokens.weight"]["data_offsets"][1] = end
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    f.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])


def _truncate(path: Path) -> None:
    f = path / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])


def _lying_tokenizer(path: Path) -> None:
    """A tokenizer.json whose added token has an id far beyond the embedding's rows."""
    tok = {
        "version": "1.0",
        "added_tokens": [{"id": 1 << 30, "content": "<huge>", "special": True}],
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []},
    }
    (path / "tokenizer.json").write_text(json.dumps(tok))


# case -> (mutation, expected job error code, a text the error message must contain)
HOSTILE: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "vocab-2-31": (lambda p: _config(p, vocab_size=2**31 - 1), "corrupt_checkpoint", "vocab_size"),
    "vocab-2-24": (lambda p: _config(p, vocab_size=2**24), "corrupt_checkpoint", "vocab_size"),
    "layers-40": (
        lambda p: _config(p, num_hidden_layers=40),
        "corrupt_checkpoint",
        "num_hidden_layers",
    ),
    "intermediate-lie": (
        lambda p: _config(p, intermediate_size=4 * HIDDEN),
        "corrupt_checkpoint",
        "intermediate_size",
    ),
    "heads-lie": (
        lambda p: _config(p, num_key_value_heads=4),
        "corrupt_checkpoint",
        "num_key_value_heads",
    ),
    "huge-header": (_huge_header, "corrupt_checkpoint", "model.embed_tokens.weight"),
    "truncated": (_truncate, "corrupt_checkpoint", "truncated"),
    "nan-weights": (
        lambda p: _poison(p, "model.layers.0.mlp.down_proj.weight", float("nan")),
        "invalid_config",
        "non-finite",
    ),
    "inf-embedding": (
        lambda p: _poison(p, "model.embed_tokens.weight", float("inf")),
        "invalid_config",
        "model.embed_tokens.weight",
    ),
    "unknown-architecture": (
        lambda p: _config(p, model_type="hostile", architectures=["HostileForCausalLM"]),
        "unsupported_model",
        "hostile",
    ),
    "lying-tokenizer": (_lying_tokenizer, "corrupt_checkpoint", "tokenizer.json"),
}


def build_case(case: str, dest: Path) -> Path:
    build_gguf_llama(dest, hidden=HIDDEN)
    HOSTILE[case][0](dest)
    return dest


def build_corpus(root: Path) -> Path:
    """Every case under root/<case>/, and a healthy model as root/healthy/."""
    for case in HOSTILE:
        build_case(case, root / case)
    build_gguf_llama(root / "healthy", hidden=HIDDEN)
    return root
