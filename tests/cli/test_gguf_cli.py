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
