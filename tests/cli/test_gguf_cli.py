"""`higgs quantize --format gguf` with a dynamic target: the profile options reach the GGUF run,
and its profile is measured once into --profile-cache, then reused."""

from __future__ import annotations

import json
from pathlib import Path

from higgs_cli.main import main
from tests.fixtures import build_gguf_llama


def test_avg_bits_profiles_into_the_cache_once(tmp_path: Path) -> None:
    ckpt = build_gguf_llama(tmp_path / "tiny")
    cache = tmp_path / "cache"
    common = [
        "--format", "gguf", "--avg-bits", "6", "--profile-random-tokens",
        "--profile-tokens", "64", "--profile-context", "32",
        "--profile-cache", str(cache), "--quiet",
    ]  # fmt: skip
    assert main(["quantize", str(ckpt), "--out", str(tmp_path / "a"), *common]) == 0
    (cached,) = cache.glob("profile-*.json")
    cfg = json.loads(cached.read_text())["config"]
    assert (cfg["data_free"], cfg["context"], cfg["windows"]) == ("random", 32, 2)
    first = json.loads((tmp_path / "a" / "report.json").read_text())
    assert first["metrics"]["target"] == {"avg_bits": 6.0}
    assert "profiling" in first["timings"]  # measured

    assert main(["quantize", str(ckpt), "--out", str(tmp_path / "b"), *common]) == 0
    again = json.loads((tmp_path / "b" / "report.json").read_text())
    assert "profiling" not in again["timings"]  # found in the cache
    assert list(cache.glob("profile-*.json")) == [cached]


def test_split_size_is_in_gib_as_the_default_and_the_docs(tmp_path: Path) -> None:
    """One constant, one unit: --split-max-size is GiB like DEFAULT_SPLIT_GIB, and README and
    the CLI and API docs give the same threshold."""
    from higgs_engine.planning.gguf_types import DEFAULT_SPLIT_BYTES, DEFAULT_SPLIT_GIB, GIB

    ckpt = build_gguf_llama(tmp_path / "tiny")
    out = tmp_path / "out"
    args = ["--format", "gguf", "--bits", "8", "--split-max-size", "1.5", "--threads", "1"]
    assert main(["quantize", str(ckpt), "--out", str(out), *args, "--quiet"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["config"]["split_max_bytes"] == int(1.5 * GIB)
    assert len(rep["metrics"]["gguf_files"]) == 1  # the tiny checkpoint is far below 1.5 GiB
    assert DEFAULT_SPLIT_BYTES == DEFAULT_SPLIT_GIB * GIB
    root = Path(__file__).resolve().parents[2]
    for doc in ("README.md", "docs/cli.md", "docs/api.md"):
        text = " ".join((root / doc).read_text().split())
        assert f"above {DEFAULT_SPLIT_GIB} GiB of 16-bit weights" in text, doc
        assert f"{DEFAULT_SPLIT_GIB} GB" not in text, doc
