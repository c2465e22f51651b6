"""`higgs quantize --format gguf --rotate`: the option reaches the GGUF run and its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_quantize_eval import assert_one_line_error, run
from tests.fixtures import build_gguf_llama, build_tiny_encoder


# slow: a whole `higgs quantize --format gguf --rotate on` process
@pytest.mark.slow
def test_rotate_on_writes_a_rotated_file(tmp_path: Path) -> None:
    ckpt = build_gguf_llama(tmp_path / "tiny", tie_word_embeddings=True)
    out = tmp_path / "out"
    res = run("quantize", str(ckpt), "--out", str(out), "--format", "gguf", "--bits", "8")
    assert res.returncode == 0, res.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["metrics"]["rotate"] == "off" and not rep["metrics"]["rotated"]
    out2 = tmp_path / "out2"
    res = run(
        "quantize", str(ckpt), "--out", str(out2), "--format", "gguf", "--bits", "8",
        "--rotate", "on",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "rotation (randomized Hadamard 256): kept" in res.stdout + res.stderr
    rep = json.loads((out2 / "report.json").read_text())
    assert rep["metrics"]["rotated"] and rep["config"]["rotate"] == "on"
    assert "output.weight" in {layer["name"] for layer in rep["layers"]}


def test_rotate_errors(tmp_path: Path) -> None:
    bert = build_tiny_encoder(tmp_path / "bert")
    out = tmp_path / "out"
    assert_one_line_error(
        run("quantize", str(bert), "--out", str(out), "--format", "gguf", "--rotate", "on"),
        "--rotate",
        "BertModel",
    )
    assert_one_line_error(
        run("quantize", str(bert), "--out", str(out), "--rotate", "on"), "--format gguf"
    )
    assert not out.exists()
