"""Evaluation: windows, perplexity (checked against the model's own loss), KL from a base."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from higgs_engine.errors import CancelledError, InvalidConfigError
from higgs_engine.evaluate import (
    base_log_probs,
    evaluate_model,
    evaluate_windows,
    read_text,
    text_windows,
    tokenize,
)


@pytest.fixture(scope="module")
def models(
    llama_ckpt: Path, tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
):
    from tests.fixtures import build_tiny_checkpoint

    other = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("other") / "llama_seed1", seed=1)
    base = AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32).eval()
    alt = AutoModelForCausalLM.from_pretrained(str(other), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(llama_ckpt))
    return base, alt, tok


def test_windows_are_non_overlapping_prefix() -> None:
    ids = torch.arange(100)
    w = text_windows(ids, context=16, windows=3)
    assert w.shape == (3, 16)
    assert torch.equal(w.reshape(-1), ids[:48])
    assert text_windows(ids, context=16, windows=40).shape == (6, 16)  # only 6 fit
    with pytest.raises(InvalidConfigError, match="fewer than one window"):
        text_windows(ids, context=101, windows=1)
    with pytest.raises(InvalidConfigError, match="context=1"):
        text_windows(ids, context=1, windows=1)
    with pytest.raises(InvalidConfigError, match="windows=0"):
        text_windows(ids, context=8, windows=0)


def test_perplexity_matches_the_models_own_loss(models, tiny_text_file: Path) -> None:
    base, _, tok = models
    windows = text_windows(tokenize(tok, read_text(tiny_text_file)), context=32, windows=3)
    res = evaluate_windows(base, windows)
    with torch.no_grad():
        losses = [
            base(input_ids=w.unsqueeze(0), labels=w.unsqueeze(0)).loss.item() for w in windows
        ]
    assert res.tokens == 3 * 31
    assert res.kl is None
    assert res.ppl == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-5)


def test_kl_zero_against_itself_and_positive_otherwise(models, tiny_text_file: Path) -> None:
    base, alt, tok = models
    text = read_text(tiny_text_file)
    same = evaluate_model(base, tok, text, context=32, windows=2, base=base)
    assert same.kl is not None and abs(same.kl) < 1e-6
    diff = evaluate_model(alt, tok, text, context=32, windows=2, base=base)
    assert diff.kl is not None and diff.kl > 1e-4


def test_cached_base_log_probs_give_the_same_kl(
    models, tiny_text_file: Path, tmp_path: Path
) -> None:
    base, alt, tok = models
    windows = text_windows(tokenize(tok, read_text(tiny_text_file)), context=32, windows=3)
    direct = evaluate_windows(alt, windows, base)
    in_mem = evaluate_windows(alt, windows, base_log_probs(base, windows))
    on_disk = evaluate_windows(
        alt, windows, base_log_probs(base, windows, cache_dir=tmp_path / "c")
    )
    half = evaluate_windows(alt, windows, base_log_probs(base, windows, dtype=torch.float16))
    assert (
        direct.kl is not None
        and in_mem.kl is not None
        and on_disk.kl is not None
        and half.kl is not None
    )
    assert in_mem.kl == pytest.approx(direct.kl, rel=1e-6)
    assert on_disk.kl == pytest.approx(direct.kl, rel=1e-6)
    assert half.kl == pytest.approx(direct.kl, rel=2e-2)
    assert len(list((tmp_path / "c").glob("*.safetensors"))) == 3
    with pytest.raises(InvalidConfigError, match="different windows"):
        evaluate_windows(alt, windows[:2], base_log_probs(base, windows))


def test_progress_and_cancel(models, tiny_text_file: Path) -> None:
    base, _, tok = models
    windows = text_windows(tokenize(tok, read_text(tiny_text_file)), context=16, windows=4)
    seen: list[tuple[str, int, int]] = []
    evaluate_windows(base, windows, progress=lambda s, d, t: seen.append((s, d, t)))
    assert seen[0] == ("evaluating", 0, 4) and seen[-1] == ("evaluating", 4, 4)
    with pytest.raises(CancelledError):
        evaluate_windows(base, windows, progress=lambda s, d, t: d < 2)


def test_read_text_rejects_bad_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match="does not exist"):
        read_text(tmp_path / "nope.txt")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(InvalidConfigError, match="not a UTF-8 text file"):
        read_text(binary)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(InvalidConfigError, match="empty"):
        read_text(empty)
