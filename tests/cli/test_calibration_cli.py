"""`higgs quantize --calibration FILE|self`: calibrated HIGGS from the command line, the report
naming the text, and one-line errors (nothing written) for unusable calibration files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from higgs_cli.main import main
from higgs_engine.calibration import MAX_CALIBRATION_BYTES


@pytest.fixture(scope="module")
def cal_file(tiny_text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("cal") / "calibration.txt"
    f.write_text(tiny_text_file.read_text() * 20, encoding="utf-8")
    return f


def _quantize(ckpt: Path, out: Path, *extra: str) -> list[str]:
    return ["quantize", str(ckpt), "--out", str(out), "--quiet", *extra]


def test_calibrated_quantize_reports_the_text(
    llama_ckpt: Path, cal_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "q"
    argv = _quantize(llama_ckpt, out, "--bits", "4", "--calibration", str(cal_file))
    assert main([*argv, "--calibration-tokens", "256", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    cal = rep["metrics"]["calibration"]
    assert cal["sha256"] == hashlib.sha256(cal_file.read_bytes()).hexdigest()
    assert cal["tokens"] == 256 and cal["source"] == "file:calibration.txt"
    assert cal["layers_calibrated"] == rep["metrics"]["quantized_layers"]
    assert json.loads((out / "report.json").read_text())["metrics"]["calibration"] == cal
    # The human summary says it too.
    assert main([*_quantize(llama_ckpt, tmp_path / "h", "--calibration", str(cal_file)),
                 "--calibration-tokens", "128"]) == 0  # fmt: skip
    assert "calibrated on 128 tokens of file:calibration.txt" in capsys.readouterr().out


def test_calibrated_dynamic_shares_the_text_with_the_profile(
    llama_ckpt: Path, cal_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "d"
    argv = _quantize(llama_ckpt, out, "--avg-bits", "4", "--calibration", str(cal_file))
    extra = ["--calibration-tokens", "128", "--profile-fast", "--profile-tokens", "128"]
    extra += ["--profile-context", "64", "--profile-cache", str(tmp_path / "cache"), "--json"]
    assert main([*argv, *extra]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["metrics"]["calibration"]["tokens"] == 128
    digest = hashlib.sha256(cal_file.read_text().encode()).hexdigest()
    assert rep["metrics"]["profile"]["calibration"] == "text:" + digest
    assert rep["bits_per_weight"] <= 4.0 + 1e-9


def test_calibration_self(
    llama_ckpt: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    argv = ["--calibration", "self", "--calibration-tokens", "128", "--json"]
    assert main([*_quantize(llama_ckpt, tmp_path / "s1"), *argv]) == 0
    first = json.loads(capsys.readouterr().out)["metrics"]["calibration"]
    assert first["source"].startswith("self:") and first["tokens"] == 128
    # Cached beside the profiles (the CLI's cache), never in a place the engine picks itself.
    cached = list((tmp_path / "home" / ".cache" / "higgs" / "profiles").glob("selfgen-*"))
    assert len(cached) == 1
    # Second run: the cached text, the same tokens.
    assert main([*_quantize(llama_ckpt, tmp_path / "s2"), *argv]) == 0
    second = json.loads(capsys.readouterr().out)["metrics"]["calibration"]
    assert second == first


def test_unusable_calibration_is_one_line_and_writes_nothing(
    llama_ckpt: Path, cal_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x00\x01\x02binary\xff" * 10)
    large = tmp_path / "large.txt"
    with large.open("wb") as f:
        f.truncate(MAX_CALIBRATION_BYTES + 1)
    out = tmp_path / "never"
    cases = [
        (["--calibration", str(empty)], ["--calibration", "empty"]),
        (["--calibration", str(binary)], ["--calibration", "not"]),
        (["--calibration", str(large)], ["--calibration", "byte limit"]),
        (["--calibration", str(tmp_path / "missing.txt")], ["--calibration", "does not exist"]),
        (
            ["--calibration", str(cal_file), "--calibration-tokens", "1000000"],
            ["--calibration", "fewer than the 1000000 requested"],
        ),
        (["--calibration-tokens", "64"], ["--calibration-tokens needs --calibration"]),
        (["--calibration", str(cal_file), "--calibration-tokens", "1"], ["at least 2"]),
    ]
    for extra, needles in cases:
        rc = main(_quantize(llama_ckpt, out, *extra))
        err = capsys.readouterr().err
        assert rc == 2, (extra, err)
        assert err.count("\n") == 1 and err.startswith("higgs: error: "), err
        for n in needles:
            assert n in err, (extra, err)
        assert not out.exists() and not [
            p for p in tmp_path.iterdir() if p.name.startswith(".never")
        ]
