"""Shared fixtures: tiny but real Hugging Face checkpoints saved to disk.

Every checkpoint is built by transformers from a small random config and written with
`save_pretrained(safe_serialization=True)`, together with a tiny byte-level BPE tokenizer
trained in memory (no network, no downloaded weights). Everything is session-scoped: build
once, then treat the directories as read-only (copy them if a test must modify one).

Helpers other test folders may import: `build_tiny_checkpoint(kind, dest, ...)`,
`build_tiny_tokenizer(dest)`, `TINY_KINDS`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TINY_KINDS = ("llama", "qwen2", "gemma2", "gpt2")

# A few sentences of plain English, repeated: enough tokens for several eval windows.
TINY_TEXT = (
    "The committee met on Tuesday to discuss the new budget for the city library. "
    "Several members argued that the reading rooms needed longer opening hours, "
    "while others wanted to spend the money on digital services and new computers. "
    "After a long debate the council agreed to fund both projects over two years. "
    "Local residents welcomed the decision and said the library was the heart of town. "
)


def _tiny_config(kind: str, **overrides: Any) -> Any:
    from transformers import Gemma2Config, GPT2Config, LlamaConfig, Qwen2Config

    vocab = 320
    # The decoder-only families share these sizes; each adds what makes it itself.
    common: dict[str, Any] = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=256,
    )
    if kind == "llama":
        # intermediate 96 = 64 + 32: down_proj rows are covered by two rotation blocks.
        kw = dict(common, intermediate_size=96, tie_word_embeddings=False)
        return LlamaConfig(**{**kw, **overrides})
    if kind == "qwen2":
        kw = dict(common, intermediate_size=128, tie_word_embeddings=True)
        return Qwen2Config(**{**kw, **overrides})
    if kind == "gemma2":
        kw = dict(common, intermediate_size=128, head_dim=16, sliding_window=32)
        return Gemma2Config(**{**kw, **overrides})
    if kind == "gpt2":
        kw = dict(
            n_embd=64,
            n_layer=2,
            n_head=4,
            vocab_size=vocab,
            n_positions=256,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2Config(**{**kw, **overrides})
    raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {TINY_KINDS}")


def build_tiny_tokenizer(dest: Path) -> Path:
    """Train a byte-level BPE (vocab < 320) on TINY_TEXT and save it as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator([TINY_TEXT * 4], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    dest.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(dest))
    return dest


def build_tiny_checkpoint(
    kind: str,
    dest: Path,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Write a random tiny `kind` model (see TINY_KINDS) to `dest` as safetensors (+ tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _tiny_config(kind, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init at std 0.02 makes every layer look alike; widen a few rows so that the
    # quantizer sees some outliers, as in real checkpoints.
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(0.05 * torch.randn(p.shape, generator=g) ** 3)
    dest.mkdir(parents=True, exist_ok=True)
    kw: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kw["max_shard_size"] = max_shard_size
    model.save_pretrained(str(dest), **kw)
    if tokenizer:
        build_tiny_tokenizer(dest)
    return dest


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"llama", "qwen2", "gemma2", "gpt2", "llama_sharded"} -> checkpoint directory."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {kind: build_tiny_checkpoint(kind, root / kind) for kind in TINY_KINDS}
    out["llama_sharded"] = build_tiny_checkpoint(
        "llama", root / "llama_sharded", max_shard_size="60KB"
    )
    return out


@pytest.fixture(scope="session")
def llama_ckpt(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def qwen2_ckpt(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["qwen2"]


@pytest.fixture(scope="session")
def gemma_ckpt(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["gemma2"]


@pytest.fixture(scope="session")
def gpt2_ckpt(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["gpt2"]


@pytest.fixture(scope="session")
def sharded_ckpt(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["llama_sharded"]


@pytest.fixture(scope="session")
def tiny_text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "news.txt"
    path.write_text(TINY_TEXT * 12, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for a module (use with pytest.mark.usefixtures): on two cores
    shared by many processes, one thread is far faster than two contending."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
