"""`higgs quantize ENCODER --avg-bits B` end to end on a tiny BERT sentence encoder: the profile
picks the cos metric by itself, the allocation meets the budget, and both artifacts load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from higgs_cli.main import main
from tests.fixtures import TINY_TEXT, build_tiny_encoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT whose weight file also keeps embeddings.position_ids, as checkpoints written
    by older transformers (all-MiniLM-L6-v2 among them) do."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_encoder(tmp_path_factory.mktemp("enc") / "bert")
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    tensors["embeddings.position_ids"] = torch.arange(128).unsqueeze(0)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return path


def pooled(model: torch.nn.Module, tok: object) -> torch.Tensor:
    batch = tok(TINY_TEXT.split(". ")[:4], padding=True, return_tensors="pt")  # type: ignore[operator]
    with torch.no_grad():
        h = model(**batch).last_hidden_state.float()
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)


def test_avg_bits_on_an_encoder_end_to_end(bert: Path, tmp_path: Path) -> None:
    from higgs_engine.artifacts import load_model

    out = tmp_path / "q"
    rc = main(
        [
            "quantize",
            str(bert),
            "--avg-bits",
            "4.13",
            "--out",
            str(out),
            "--profile-cache",
            str(tmp_path / "cache"),
            "--quiet",
        ]
    )
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    m = rep["metrics"]
    assert m["metric"] == "cos" and m["profile"]["metric"] == "cos"
    assert m["profile"]["calibration"] == "random:0"  # an encoder's data-free tokens
    assert m["profile"]["method"] == "fisher" and m["predicted_ppl_increase"] is None
    assert m["target"] == {"avg_bits": 4.13} and m["allocation"]["avg_bits"] <= 4.13
    assert m["predicted_cos"] > 0
    # the profile the cache keeps says what it measured
    (cached,) = (tmp_path / "cache").glob("profile-*.json")
    cfg = json.loads(cached.read_text())["config"]
    assert (cfg["metric"], cfg["data_free"], cfg["context"]) == ("cos", "random", 128)

    base_model, tok = load_model(bert)
    base = pooled(base_model, tok)
    got = {}
    for kind in ("native", "dequantized"):
        model, tok2 = load_model(out / kind)
        assert type(model).__name__ == "BertModel" and tok2 is not None
        got[kind] = pooled(model, tok2)
    one_minus_cos = 1 - (got["dequantized"] * base).sum(-1)
    assert bool((one_minus_cos > 0).all()) and float(one_minus_cos.max()) < 0.2, one_minus_cos
    assert torch.allclose(got["native"], got["dequantized"], atol=2e-2)


def test_lm_metrics_on_an_encoder_are_one_line_errors(
    bert: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        (["--avg-bits", "4", "--profile-metric", "kl"], "metric='kl' needs a causal LM head"),
        (["--max-ppl-increase", "0.05"], "give avg_bits instead"),
    ]
    for extra, msg in cases:
        args = ["quantize", str(bert), "--out", str(tmp_path / "x"), "--quiet", *extra]
        rc = main([*args, "--profile-cache", str(tmp_path / "c")])
        err = capsys.readouterr().err
        assert rc != 0, extra
        assert err.count("\n") == 1 and msg in err, (extra, err)
        assert not (tmp_path / "x" / "report.json").exists()
