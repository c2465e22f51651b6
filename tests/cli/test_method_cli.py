"""`higgs quantize --method`: a registered method chosen through the job's config, end to end
on a tiny checkpoint, and one-line errors for what the method cannot do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from higgs_engine.baselines import nf4_quantize, rtn_quantize
from higgs_engine.model_structure import load_config, scope_specs
from higgs_engine.safetensors_stream import CheckpointReader

HIGGS = [sys.executable, "-m", "higgs_cli.main"]
ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HIGGS, *args], capture_output=True, text=True, timeout=600, cwd=ROOT)


def one_line_error(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode != 0, res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("higgs: error: "), res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize(
    ("method", "bits", "reference"),
    [
        ("rtn", "3", lambda w: rtn_quantize(w, 3, 256)),
        ("nf4", "4", lambda w: nf4_quantize(w, 256)),
    ],
)
def test_a_baseline_method_writes_its_dequantized_weights(
    llama_ckpt: Path, tmp_path: Path, method: str, bits: str, reference: object
) -> None:
    out = tmp_path / "q"
    res = run(
        "quantize",
        str(llama_ckpt),
        "--out",
        str(out),
        "--bits",
        bits,
        "--method",
        method,
        "--format",
        "dequantized",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["config"]["method"] == method
    assert sorted(p.name for p in out.iterdir()) == ["dequantized", "report.json"]
    with (
        CheckpointReader(llama_ckpt) as reader,
        safe_open(str(out / "dequantized" / "model.safetensors"), framework="pt") as got,
    ):
        specs = scope_specs(load_config(llama_ckpt), reader.keys(), "linear")
        assert specs
        rows = {r["name"]: r for r in rep["layers"]}
        for spec in specs:
            w_hat, bpw = reference(spec.weight(reader))  # type: ignore[operator]
            want = (w_hat.t() if spec.transposed else w_hat).contiguous().half()
            assert torch.equal(got.get_tensor(spec.key), want), spec.name
            assert rows[spec.name]["bits"] == pytest.approx(bpw)


def test_the_default_method_leaves_the_config_as_it_was(llama_ckpt: Path, tmp_path: Path) -> None:
    """--method higgs is the default: the config (and so every artifact byte) has no method."""
    runs = {}
    for name, extra in (("plain", ()), ("higgs", ("--method", "higgs"))):
        out = tmp_path / name
        res = run("quantize", str(llama_ckpt), "--out", str(out), "--bits", "4", *extra)
        assert res.returncode == 0, res.stderr
        runs[name] = out
    assert "method" not in json.loads((runs["higgs"] / "report.json").read_text())["config"]
    for fmt in ("native", "dequantized"):
        for f in ("model.safetensors", "config.json"):
            assert (runs["plain"] / fmt / f).read_bytes() == (runs["higgs"] / fmt / f).read_bytes()


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--bits", "4", "--method", "rtn"), ("method='rtn'", "native")),
        (("--bits", "4.5", "--method", "rtn", "--format", "dequantized"), ("whole number",)),
        (("--bits", "3", "--method", "nf4", "--format", "dequantized"), ("4-bit",)),
        (("--bits", "4", "--method", "higgs-gptq"), ("method='higgs-gptq'", "calibration")),
        (
            ("--avg-bits", "4", "--method", "rtn", "--format", "dequantized"),
            ("dynamic target",),
        ),
        (
            ("--bits", "4", "--method", "rtn", "--format", "dequantized", "--calibration", "self"),
            ("data-free",),
        ),
        (("--bits", "4", "--method", "rtn", "--format", "gguf"), ("--method",)),
    ],
)
def test_what_a_method_cannot_do_is_a_one_line_error(
    llama_ckpt: Path, tmp_path: Path, args: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    out = tmp_path / "q"
    one_line_error(run("quantize", str(llama_ckpt), "--out", str(out), *args), *needles)
    assert not out.exists()
