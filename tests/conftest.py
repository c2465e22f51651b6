"""Shared fixtures: tiny but real Hugging Face checkpoints saved to disk (built by the helpers
in tests/fixtures.py), a small text file, and a one-torch-thread switch. Everything is
session-scoped unless it says otherwise: build once, then treat the directories as read-only
(copy them if a test must modify one). Test modules import helpers from tests/fixtures.py,
never from a conftest.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import TINY_KINDS, TINY_TEXT, build_tiny_checkpoint, build_tiny_tokenizer

# Tests never reach the Hub: the API's submit-time architecture check of Hub models is off in
# every Settings the tests (and the servers they start) build, unless a test sets it.
os.environ.setdefault("HIGGS_HUB_CHECK_TIMEOUT_S", "0")


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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3 server (SeaweedFS `weed mini` from the dev extra) on loopback ports, with
    bucket "higgs"; devtools.seaweed.S3Server (endpoint, env, client())."""
    from devtools.seaweed import running_s3

    with running_s3(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture(autouse=True)
def private_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI caches profiles and self-generated text under $XDG_CACHE_HOME: each test gets
    its own, so no test reuses (or leaves behind) another's cached profile."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
