"""Reduced quality check on the real models (CI): a quality regression fails the build.

SmolLM2-135M on 8 windows of 512 news tokens (KL from the base model) and all-MiniLM-L6-v2 on
300 news sentences (mean 1 - cosine of sentence embeddings): HIGGS p=2 n=256 must beat RTN-4
g128 and HIGGS p=2 n=512 must beat NF4 b64, both at fewer or about equal bits. Same code as
benchmarks/quality.py (devtools/quality.py). Needs data/ from scripts/prepare_data.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from devtools.quality import (
    MINILM_DIR,
    NEWS_FILE,
    SMOLLM_DIR,
    CausalLMEval,
    EmbeddingEval,
    SimulatedModel,
    data_ready,
    load_causal_lm,
    load_encoder,
    news_sentences,
    run_methods,
    select_methods,
)

READY, WHY = data_ready()
pytestmark = [
    pytest.mark.realdata,
    pytest.mark.slow,
    pytest.mark.skipif(not READY, reason=WHY),
    # the module fixture runs five methods over the real models: minutes on 2 cores, more under load
    pytest.mark.timeout(2400),
]

METHODS = ["base", "RTN-4 g128", "NF4 b64", "HIGGS p=2 n=256", "HIGGS p=2 n=512"]


def _by_name(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["method"]: r for r in rows}


@pytest.fixture(scope="module")
def smollm_rows() -> dict[str, dict[str, Any]]:
    model, tok = load_causal_lm(SMOLLM_DIR)
    evaluator = CausalLMEval(tok, NEWS_FILE.read_text(), context=512, windows=8)
    assert evaluator.windows.shape == (8, 512)
    # No second base pass here (KL ~ 0 of the base against itself is checked on MiniLM and in
    # tests/engine/test_evaluate.py): it would cost a fifth of this test's time.
    return _by_name(run_methods(SimulatedModel(model), evaluator, select_methods(METHODS)))


@pytest.fixture(scope="module")
def minilm_rows() -> dict[str, dict[str, Any]]:
    model, tok = load_encoder(MINILM_DIR)
    evaluator = EmbeddingEval(tok, news_sentences(NEWS_FILE.read_text(), 300))
    return _by_name(
        run_methods(SimulatedModel(model), evaluator, select_methods(METHODS), check_base=True)
    )


def _beats(
    rows: dict[str, dict[str, Any]], win: str, lose: str, metric: str, slack_bits: float
) -> None:
    a, b = rows[win], rows[lose]
    assert a[metric] < b[metric], (
        f"{win} {metric}={a[metric]:.5g} does not beat {lose} {metric}={b[metric]:.5g}"
    )
    # "at equal or fewer bits": the winner may not buy its quality with many more bits
    assert a["bits"] <= b["bits"] + slack_bits, (win, a["bits"], lose, b["bits"])


def test_smollm_evaluation_is_sane(smollm_rows: dict[str, dict[str, Any]]) -> None:
    base = smollm_rows["base"]
    assert 5 < base["ppl"] < 200, base["ppl"]
    for name in METHODS[1:]:
        row = smollm_rows[name]
        assert row["kl"] > 1e-3 and row["ppl"] > base["ppl"], row
        assert 0 < row["rel_error"] < 0.1, row


def test_smollm_higgs256_beats_rtn4(smollm_rows: dict[str, dict[str, Any]]) -> None:
    _beats(smollm_rows, "HIGGS p=2 n=256", "RTN-4 g128", "kl", slack_bits=0.0)


def test_smollm_higgs512_beats_nf4(smollm_rows: dict[str, dict[str, Any]]) -> None:
    # 4.58 vs 4.5 bits: SmolLM2's 576-wide rows end in a 64-wide block with its own scale
    _beats(smollm_rows, "HIGGS p=2 n=512", "NF4 b64", "kl", slack_bits=0.1)


def test_minilm_evaluation_is_sane(minilm_rows: dict[str, dict[str, Any]]) -> None:
    assert minilm_rows["base"]["one_minus_cos"] < 1e-5
    for name in METHODS[1:]:
        assert 1e-5 < minilm_rows[name]["one_minus_cos"] < 0.5, minilm_rows[name]


def test_minilm_higgs256_beats_rtn4(minilm_rows: dict[str, dict[str, Any]]) -> None:
    _beats(minilm_rows, "HIGGS p=2 n=256", "RTN-4 g128", "one_minus_cos", slack_bits=0.0)


def test_minilm_higgs512_beats_nf4(minilm_rows: dict[str, dict[str, Any]]) -> None:
    _beats(minilm_rows, "HIGGS p=2 n=512", "NF4 b64", "one_minus_cos", slack_bits=0.1)
