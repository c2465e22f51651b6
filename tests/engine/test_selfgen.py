"""Self-generated text on a tiny real checkpoint: seeded, cached, well-formed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from higgs_engine.errors import InvalidConfigError
from higgs_engine.model_loading import load_float_model
from higgs_engine.selfgen import (
    SelfGenConfig,
    _nucleus_top,
    cached_self_tokens,
    sample_next,
    sample_rows,
    self_generated_tokens,
    self_generated_tokens_reference,
    selfgen_cache_path,
    start_token,
    windows_from_sequences,
)
from tests.fixtures import build_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = SelfGenConfig(count=3, length=24, seed=5)


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, object]:
    ckpt = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("selfgen") / "llama")
    return load_float_model(ckpt)


def test_same_seed_same_tokens_other_seed_other_tokens(model_tok: tuple) -> None:
    model, tok = model_tok
    rng_before = torch.random.get_rng_state()
    a = self_generated_tokens(model, tok, CFG)
    b = self_generated_tokens(model, tok, CFG)
    c = self_generated_tokens(model, tok, SelfGenConfig(count=3, length=24, seed=6))
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # global RNG untouched
    assert a.shape == (3, 24) and a.dtype == torch.int64
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    vocab = int(model.config.vocab_size)
    assert int(a.min()) >= 0 and int(a.max()) < vocab
    bos = start_token(model, tok)
    assert bool((a[:, 0] == bos).all())
    # sequences open with different neutral prompts
    assert len({tuple(row[:3].tolist()) for row in a}) > 1


def test_tokens_follow_the_model(model_tok: tuple) -> None:
    """Sampled continuations are likelier under the model than uniform random tokens."""
    model, tok = model_tok
    gen = self_generated_tokens(model, tok, SelfGenConfig(count=4, length=32, seed=1))
    rnd = torch.randint(
        0, int(model.config.vocab_size), gen.shape, generator=torch.Generator().manual_seed(0)
    )
    rnd[:, 0] = gen[:, 0]

    def nll(ids: torch.Tensor) -> float:
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
        return float(-lp.gather(-1, ids[:, 1:, None]).mean())

    assert nll(gen) < nll(rnd)


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, 0.8, g)[0]) for _ in range(200)}
    assert draws == {0, 1}
    draws = {int(sample_next(logits, 1.0, 1.0, g)[0]) for _ in range(400)}
    assert draws == {0, 1, 2, 3}
    # a tiny top_p still keeps the most likely token
    assert {int(sample_next(logits, 1.0, 0.01, g)[0]) for _ in range(50)} == {0}


def test_cache_hit_and_keying(
    model_tok: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok = model_tok
    first = cached_self_tokens(model, tok, "rev-a", tmp_path, CFG)
    path = selfgen_cache_path(tmp_path, "rev-a", CFG)
    assert path.is_file()
    calls: list[int] = []
    import higgs_engine.selfgen as sg

    real = sg.self_generated_tokens

    def counting(*a: object, **k: object) -> torch.Tensor:
        calls.append(1)
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(sg, "self_generated_tokens", counting)
    again = cached_self_tokens(model, tok, "rev-a", tmp_path, CFG)
    assert torch.equal(first, again) and calls == []  # served from the file
    # another revision or another setting is another file
    cached_self_tokens(model, tok, "rev-b", tmp_path, CFG)
    assert calls == [1]
    assert selfgen_cache_path(tmp_path, "rev-b", CFG) != path
    assert selfgen_cache_path(tmp_path, "rev-a", SelfGenConfig(count=3, length=24, seed=6)) != path
    # a corrupt cache file is regenerated, not trusted
    path.write_bytes(b"not a safetensors file")
    fixed = cached_self_tokens(model, tok, "rev-a", tmp_path, CFG)
    assert torch.equal(fixed, first) and calls == [1, 1]


def greedy_reference(model: torch.nn.Module, start: list[int], length: int) -> list[int]:
    """Greedy decoding of one sequence by full forward passes: no cache, no padding."""
    ids = list(start)
    cfg: Any = model.config
    with torch.no_grad():
        while len(ids) < length:
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits[: int(cfg.vocab_size)].argmax()))
    return ids


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
def test_batched_padded_sampling_matches_one_sequence_at_a_time(kind: str, tmp_path: Path) -> None:
    """With a nucleus so small that sampling is greedy, every row of a batch whose openings have
    different lengths (left-padded, masked, own positions) continues exactly as that opening
    alone, decoded without cache or padding."""
    model, tok = load_float_model(build_tiny_checkpoint(kind, tmp_path / kind))
    cfg = SelfGenConfig(count=5, length=14, seed=0, top_p=1e-9, batch=4)
    got = self_generated_tokens(model, tok, cfg)
    from higgs_engine.selfgen import _starts

    starts = _starts(model, tok, cfg)
    assert len({len(s) for s in starts}) > 1  # the batch really mixes opening lengths
    for row, start in zip(got.tolist(), starts, strict=True):
        assert row[: len(start)] == start
        assert row == greedy_reference(model, start, cfg.length)
    # the batch size is a setting: one row at a time gives the same greedy text
    assert torch.equal(got, self_generated_tokens(model, tok, replace(cfg, batch=1)))


def test_no_tokenizer_starts_from_bos_only(model_tok: tuple) -> None:
    model, _ = model_tok
    a = self_generated_tokens(model, None, SelfGenConfig(count=2, length=10, seed=0))
    assert bool((a[:, 0] == start_token(model)).all())


def test_bad_settings_are_named() -> None:
    with pytest.raises(InvalidConfigError, match="top_p"):
        SelfGenConfig(top_p=0.0)
    with pytest.raises(InvalidConfigError, match="temperature"):
        SelfGenConfig(temperature=0.0)
    with pytest.raises(InvalidConfigError, match="length"):
        SelfGenConfig(length=1)
    with pytest.raises(InvalidConfigError, match="batch=0"):
        SelfGenConfig(batch=0)
    with pytest.raises(InvalidConfigError, match="windows"):
        windows_from_sequences(torch.zeros(2, 8, dtype=torch.int64), 3, 8)
    assert windows_from_sequences(torch.arange(32).view(2, 16), 2, 8).shape == (2, 8)


@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_other_architectures(kind: str, tmp_path: Path) -> None:
    model, tok = load_float_model(build_tiny_checkpoint(kind, tmp_path / kind))
    cfg = SelfGenConfig(count=2, length=12, seed=3)
    a = self_generated_tokens(model, tok, cfg)
    assert a.shape == (2, 12) and torch.equal(a, self_generated_tokens(model, tok, cfg))


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
def test_greedy_default_path_matches_the_reference_twin(kind: str, tmp_path: Path) -> None:
    """With a greedy nucleus, the default path (all sequences in one batch, a generator per
    sequence, nucleus from a top-k) gives the reference twin's tokens (batch of 2, one
    generator, full sort)."""
    model, tok = load_float_model(build_tiny_checkpoint(kind, tmp_path / kind))
    cfg = SelfGenConfig(count=5, length=14, seed=0, top_p=1e-9)
    ref = self_generated_tokens_reference(model, tok, replace(cfg, batch=2))
    assert torch.equal(self_generated_tokens(model, tok, cfg), ref)


def test_sampled_text_does_not_depend_on_the_batch(model_tok: tuple) -> None:
    """Each sequence draws from its own stream: the batch size changes at most rounding."""
    model, tok = model_tok
    cfg = SelfGenConfig(count=5, length=20, seed=2)
    a = self_generated_tokens(model, tok, cfg)
    b = self_generated_tokens(model, tok, replace(cfg, batch=2))
    assert torch.equal(a, b)
    # the first sequences do not depend on how many follow
    assert torch.equal(self_generated_tokens(model, tok, replace(cfg, count=2)), a[:2])


def test_top_k_nucleus_is_the_full_sort_nucleus() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3000, generator=g, dtype=torch.float64) * 3
    # nearly flat (no ties): the nucleus needs most of the vocabulary (a full sort)
    logits[0] = torch.randn(3000, generator=g, dtype=torch.float64) * 1e-3
    probs = torch.softmax(logits, -1)
    for top_p in (0.5, 0.95, 1.0 - 1e-12):
        full, fidx = probs.sort(dim=-1, descending=True)
        full = full.masked_fill((full.cumsum(-1) - full) >= top_p, 0.0)
        for r, (sp, idx) in enumerate(_nucleus_top(probs, top_p)):
            keep = int((full[r] > 0).sum())
            assert sp.shape == (keep,) and idx.shape == (keep,)
            assert set(idx[:keep].tolist()) == set(fidx[r, :keep].tolist())
            assert torch.equal(sp[:keep], full[r, :keep])


def test_rows_sample_the_same_distribution() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05], [0.05, 0.05, 0.3, 0.6]]))
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    draws = torch.stack([sample_rows(logits, 1.0, 0.8, gens) for _ in range(300)])
    assert set(draws[:, 0].tolist()) == {0, 1} and set(draws[:, 1].tolist()) == {2, 3}
    share = float((draws[:, 0] == 0).double().mean())
    assert 0.55 < share < 0.78  # 0.6 / 0.9 = 0.667 of the nucleus


def test_progress_counts_tokens(model_tok: tuple) -> None:
    model, tok = model_tok
    calls: list[tuple[str, int, int]] = []

    def progress(stage: str, done: int, total: int) -> bool:
        calls.append((stage, done, total))
        return True

    self_generated_tokens(model, tok, replace(CFG, batch=2), progress=progress)
    assert {c[0] for c in calls} == {"generating"}
    assert calls[0] == ("generating", 0, 3 * 24) and calls[-1] == ("generating", 3 * 24, 3 * 24)
    dones = [c[1] for c in calls]
    assert dones == sorted(dones) and len(calls) > 10
    # the slow twin counts the same unit, a batch of sequences at a time
    calls.clear()
    self_generated_tokens_reference(model, tok, replace(CFG, batch=2), progress=progress)
    assert calls == [("generating", 2 * 24, 3 * 24), ("generating", 3 * 24, 3 * 24)]
