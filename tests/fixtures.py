"""Helpers the test folders share (import them from here, never from a conftest):

- tiny but real Hugging Face checkpoints: `build_tiny_checkpoint(kind, dest, ...)` writes a
  random small model of one of TINY_KINDS with transformers' `save_pretrained` (safetensors)
  plus a byte-level BPE tokenizer trained in memory on TINY_TEXT (no network, no downloaded
  weights); TINY_MODEL is the name the worker and end-to-end tests give such a model;
  `build_tiny_encoder(dest)` the same for a BERT sentence encoder (BertModel, no LM head) with
  a WordPiece tokenizer that frames text as [CLS] ... [SEP];
- `make_hub_cache`: a checkpoint laid out as huggingface_hub stores a download;
- `files_under`: every file below a folder, sorted;
- `count_calls` / `count_resolutions`: how often a function (a source's resolution) runs;
- `assert_problem`: an RFC 9457 problem+json response with a given status (and field);
- `measure_tiny_profile`: a cheap data-free profile of a tiny checkpoint (`obtain` and
  `get_profile`, the engine's obtain_profile called on a path, are in devtools/profiles.py);
- `serve_app`: the API app served by a real uvicorn server in a thread.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
    common: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
    }
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
        kw = {
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "vocab_size": vocab,
            "n_positions": 256,
            "bos_token_id": 0,
            "eos_token_id": 0,
        }
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


def build_tiny_wordpiece_tokenizer(dest: Path) -> Path:
    """Train a BERT-style WordPiece tokenizer (vocab < 320) on TINY_TEXT: lower-cased, framed as
    [CLS] text [SEP], saved as an HF fast tokenizer."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False
    )
    tok.train_from_iterator([TINY_TEXT * 4], trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    dest.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(dest))
    return dest


def build_tiny_encoder(dest: Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a random tiny BERT sentence encoder (BertModel: no LM head, output = hidden
    states) to `dest` as safetensors, with a WordPiece tokenizer."""
    import torch
    from transformers import BertConfig, BertModel

    kw: dict[str, Any] = {
        "vocab_size": 320,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 128,
    }
    config = BertConfig(**{**kw, **config_overrides})
    torch.manual_seed(seed)
    model = BertModel(config)
    with torch.no_grad():  # some outlier rows, as in build_tiny_checkpoint
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(0.05 * torch.randn(p.shape, generator=g) ** 3)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest), safe_serialization=True)
    build_tiny_wordpiece_tokenizer(dest)
    return dest


# The name the worker and end-to-end tests give the tiny Llama in their models folder.
TINY_MODEL = "tiny"


def measure_tiny_profile(checkpoint: Path, out: Path) -> Path:
    """A data-free noise-injection profile of a tiny checkpoint, measured through `higgs profile`
    on 64 random tokens (cheap enough for a module-scoped fixture)."""
    from higgs_cli.main import main

    rc = main(
        [
            "profile",
            str(checkpoint),
            "--random-tokens",
            "--tokens",
            "64",
            "--context",
            "32",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    if rc != 0:
        raise RuntimeError(f"higgs profile {checkpoint} exited with {rc}")
    return out


def count_calls(monkeypatch: Any, module: Any, name: str) -> list[int]:
    """Count the calls of module.name wherever a loaded module holds it (imported at module
    level or at call time alike), through pytest's `monkeypatch`. Returns a one-element list:
    the count so far."""
    import sys

    original = getattr(module, name)
    seen = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        return original(*args, **kwargs)

    for mod in list(sys.modules.values()):
        if mod is not None and getattr(mod, name, None) is original:
            monkeypatch.setattr(mod, name, counted)
    return seen


def count_resolutions(monkeypatch: Any) -> dict[str, list[int]]:
    """How often sources are resolved and described, config.json read and the meta model
    built, from now on (count_calls of each)."""
    import higgs_engine.model_structure as ms
    import higgs_engine.sources as sources

    return {
        "resolve_source": count_calls(monkeypatch, sources, "resolve_source"),
        "describe_model": count_calls(monkeypatch, sources, "describe_model"),
        "load_config": count_calls(monkeypatch, ms, "load_config"),
        "build_meta_model": count_calls(monkeypatch, ms, "build_meta_model"),
    }


@contextmanager
def serve_app(settings: Any) -> Iterator[str]:
    """The API app for `settings` served by a real uvicorn server in a background thread;
    yields its base URL and stops the server on exit."""
    import uvicorn

    from app.main import create_app
    from devtools.stack import free_port

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def make_hub_cache(hub_cache: Path, repo_id: str, checkpoint: Path, branch: str = "main") -> str:
    """Lay `checkpoint` out as huggingface_hub stores a download, and return the commit sha:

    <hub_cache>/models--<owner>--<name>/blobs/<sha256 of each file>
                                       /snapshots/<commit>/<file> -> ../../blobs/<sha256>
                                       /refs/<branch>   (contains <commit>)
    """
    owner_name = repo_id.replace("/", "--")
    repo = hub_cache / f"models--{owner_name}"
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for p in files:
        data = p.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        dest = snap / p.relative_to(checkpoint)
        dest.parent.mkdir(parents=True, exist_ok=True)
        depth = len(p.relative_to(checkpoint).parts) + 1
        dest.symlink_to(Path(*([".."] * depth), "blobs", blob.name))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return commit


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def assert_problem(r: Any, status: int, field: str | None = None) -> dict[str, Any]:
    """`r` is an RFC 9457 problem+json response with this status (and this field error)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body: dict[str, Any] = r.json()
    assert body["status"] == status and body["title"] and body["type"] and body["detail"]
    if field is not None:
        assert field in [e["field"] for e in body["errors"]], body
    return body


# The app tests' HIGGS_METRICS_KEY (tests/app/conftest.py), and the header that reads /metrics.
METRICS_KEY = "metrics-test-key"
METRICS_AUTH = {"Authorization": f"Bearer {METRICS_KEY}"}


def build_tiny_spm_tokenizer(dest: Path, vocab_size: int = 320) -> Path:
    """Train a SentencePiece BPE model (byte fallback, `vocab_size` pieces) on TINY_TEXT and save
    it as dest/tokenizer.model: the Llama tokenizer format llama.cpp's converter reads without a
    table of known pre-tokenizers (a byte-level BPE trained here is unknown to that table)."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TINY_TEXT.split(". ") * 20),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.model").write_bytes(buf.getvalue())
    return dest


def build_gguf_llama(dest: Path, *, hidden: int = 256, seed: int = 0, **overrides: Any) -> Path:
    """A tiny Llama that llama.cpp's converter takes: rows of `hidden` values (256: every
    K-quant fits; 96: only the 32-value types do) and a SentencePiece tokenizer."""
    build_tiny_checkpoint(
        "llama",
        dest,
        seed=seed,
        tokenizer=False,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        **overrides,
    )
    return build_tiny_spm_tokenizer(dest)
