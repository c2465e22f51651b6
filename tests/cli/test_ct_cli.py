"""`higgs quantize --format compressed-tensors`: a directory transformers loads through
compressed-tensors, with --bits 4, with --avg-bits from a profile measured into the cache and
with --calibration; bad options are one `higgs: error:` line each, with nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from higgs_cli.main import main
from tests.fixtures import build_tiny_checkpoint

HIGGS = [sys.executable, "-m", "higgs_cli.main"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("ctcli") / "qwen2")


def test_bits_4_writes_a_checkpoint_transformers_loads(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    assert main(["quantize", str(tiny), "--out", str(out), "--format", "compressed-tensors",
                 "--quiet"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "vllm serve" in printed and "loads it" in printed
    rep = json.loads((out / "report.json").read_text())
    assert rep["config"]["bits"] == 4 and rep["formats"] == ["compressed-tensors"]
    model = AutoModelForCausalLM.from_pretrained(str(out / "compressed-tensors")).eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[3, 4, 5]])).logits).all()


def test_eval_text_measures_the_checkpoint_transformers_loads(tiny: Path, tmp_path: Path) -> None:
    from tests.fixtures import TINY_TEXT

    text = tmp_path / "eval.txt"
    text.write_text(TINY_TEXT * 20)
    out = tmp_path / "out"
    args = ["--format", "compressed-tensors", "--eval-text", str(text), "--eval-windows", "2"]
    assert main(["quantize", str(tiny), "--out", str(out), *args, "--quiet"]) == 0
    m = json.loads((out / "report.json").read_text())["metrics"]
    assert m["eval_engine"] == "transformers" and m["eval_windows"] == 2
    assert m["ppl_quantized"] > 1 and m["kl"] > 0


def test_avg_bits_profiles_once_and_allocates(tiny: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    common = [
        "--format", "compressed-tensors", "--avg-bits", "6", "--profile-random-tokens",
        "--profile-tokens", "64", "--profile-context", "32",
        "--profile-cache", str(cache), "--quiet",
    ]  # fmt: skip
    assert main(["quantize", str(tiny), "--out", str(tmp_path / "a"), *common]) == 0
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    assert rep["config"]["target"] == {"avg_bits": 6.0}
    assert rep["bits_per_weight"] <= 6.0
    assert rep["metrics"]["allocation"]["profile_reused"] is None  # measured here
    assert rep["metrics"]["predicted_kl"] > 0
    assert main(["quantize", str(tiny), "--out", str(tmp_path / "b"), *common]) == 0
    again = json.loads((tmp_path / "b" / "report.json").read_text())
    assert again["metrics"]["allocation"]["profile_reused"] is not None  # from the cache
    assert {r["name"]: r["type"] for r in again["layers"]} == {
        r["name"]: r["type"] for r in rep["layers"]
    }


def test_calibration_runs_gptq_in_the_schemes(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 37} and more" for i in range(2000)), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["quantize", str(tiny), "--out", str(out), "--format", "compressed-tensors",
                 "--bits", "4", "--calibration", str(text), "--calibration-tokens", "128",
                 "--quiet"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "calibrated: GPTQ in each scheme on 128 tokens of file:text.txt" in printed
    rep = json.loads((out / "report.json").read_text())
    assert rep["metrics"]["calibration"]["layers_calibrated"] == len(rep["layers"])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--bits", "3"], "--bits 3"),
        (["--format", "compressed-tensors,native"], "its own run"),
        (["--group-size", "64"], "--group-size"),
        (["--method", "rtn"], "--method"),
        (["--dtype", "float32"], "--dtype float32"),
        (["--avg-bits", "3"], "smallest feasible budget"),  # the smallest is named
        (["--calibration-tokens", "64"], "--calibration-tokens needs --calibration"),
        (["--calibration", "no-such-text.txt"], "no-such-text.txt"),
    ],
)
def test_bad_options_are_one_error_line(
    tiny: Path, tmp_path: Path, args: list[str], needle: str
) -> None:
    fmt = [] if "--format" in args else ["--format", "compressed-tensors"]
    extra = ["--profile-random-tokens", "--profile-tokens", "64", "--profile-context", "32",
             "--profile-cache", str(tmp_path / "cache")] if "--avg-bits" in args else []  # fmt: skip
    res = subprocess.run(
        [*HIGGS, "quantize", str(tiny), "--out", str(tmp_path / "o"), *fmt, *args, *extra,
         "--quiet"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode != 0, res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("higgs: error: "), res.stderr
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "o").exists()
