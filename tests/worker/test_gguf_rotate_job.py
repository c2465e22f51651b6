"""A gguf job's options.gguf_rotate reaches the engine's GGUF run (worker.gguf)."""

from __future__ import annotations

from pathlib import Path

import pytest

from higgs_engine.errors import InvalidConfigError
from higgs_engine.sources import ResolvedSource
from tests.fixtures import build_gguf_llama, build_tiny_encoder
from worker.gguf import quantize_gguf_job


def _no_sessions() -> None:
    raise AssertionError("a bits target needs no profile store")


# slow: a whole GGUF job with a rotation (the engine's rotation tests stay in the lane)
@pytest.mark.slow
def test_rotate_reaches_the_run(tmp_path: Path) -> None:
    ckpt = build_gguf_llama(tmp_path / "tiny")
    src = ResolvedSource(path=ckpt, id="tiny", revision=None, kind="local")
    rep = quantize_gguf_job(
        _no_sessions,  # type: ignore[arg-type]
        src,
        None,
        tmp_path / "out",
        {"bits": 8.0},
        None,
        lambda *a: None,
        rotate="on",
    )
    assert rep.metrics["rotated"] and rep.metrics["rotation"]["per_head_vo"]


def test_rotate_on_an_encoder_fails_naming_it(tmp_path: Path) -> None:
    bert = build_tiny_encoder(tmp_path / "bert")
    src = ResolvedSource(path=bert, id="bert", revision=None, kind="local")
    with pytest.raises(InvalidConfigError, match="BertModel"):
        quantize_gguf_job(
            _no_sessions,  # type: ignore[arg-type]
            src,
            None,
            tmp_path / "out",
            {"bits": 8.0},
            None,
            lambda *a: None,
            rotate="on",
        )
