"""`higgs profile`, `higgs plan` and dynamic `higgs quantize` (a target instead of --bits):
outputs, JSON, and one-line errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from higgs_cli.main import main
from tests.fixtures import build_tiny_checkpoint, measure_tiny_profile

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("dyn") / "llama")


@pytest.fixture(scope="module")
def profile_file(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return measure_tiny_profile(ckpt, tmp_path_factory.mktemp("profile") / "profile.json")


def test_cli_plan_and_dynamic_quantize(
    ckpt: Path, profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["plan", str(ckpt), "--profile", str(profile_file), "--avg-bits", "3.5", "--json"])
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["allocation"]["avg_bits"] <= 3.5 and len(plan["pareto"]) > 3
    assert main(["plan", str(ckpt), "--profile", str(profile_file)]) == 0
    out = capsys.readouterr().out
    assert "bits/weight" in out and "exp(KL) - 1" in out
    rc = main(
        [
            "quantize",
            str(ckpt),
            "--out",
            str(tmp_path / "q"),
            "--max-ppl-increase",
            "0.5",
            "--profile",
            str(profile_file),
            "--max-code-bits",
            "3",
            "--quiet",
            "--format",
            "native",
        ]
    )
    assert rc == 0
    rep = json.loads((tmp_path / "q" / "report.json").read_text())
    assert rep["metrics"]["target"] == {"max_ppl_increase": 0.5}
    assert rep["metrics"]["allocation"]["predicted_kl_grid_mse"] <= math.log(1.5) + 1e-12


def test_cli_errors_are_one_line(
    ckpt: Path, profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        (["plan", str(ckpt), "--profile", str(tmp_path / "nope.json")], "does not exist"),
        (
            ["plan", str(ckpt), "--profile", str(profile_file), "--avg-bits", "0.5"],
            "below the smallest feasible budget",
        ),
        (
            ["profile", str(ckpt), "--metric", "ppl", "--out", str(tmp_path / "p.json")],
            "needs --text",
        ),
        (["profile", str(ckpt), "--tokens", "1", "--out", str(tmp_path / "p.json")], "--tokens 1"),
        (
            ["profile", str(tmp_path / "missing"), "--out", str(tmp_path / "p.json")],
            "does not exist",
        ),
        (
            ["quantize", str(ckpt), "--out", str(tmp_path / "x"), "--avg-bits", "4", "--bits", "4"],
            "--bits",
        ),
    ]
    for argv, msg in cases:
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc != 0, argv
        assert err.count("\n") == 1 and msg in err, (argv, err)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["plan", str(ckpt), "--profile", str(bad)]) != 0
    assert "not a valid profile" in capsys.readouterr().err


def test_profile_quiet_prints_nothing_on_stderr(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "higgs_cli.main",
            "profile",
            str(ckpt),
            "--random-tokens",
            "--tokens",
            "64",
            "--context",
            "32",
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "", res.stderr  # no loading bar of transformers, no warnings
    assert json.loads(out.read_text())["layers"]


def test_avg_bits_profiles_once_then_reuses_the_cache(
    llama_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`higgs quantize SRC --avg-bits B` with no text: a self-generated-text profile the first
    time (cached under $XDG_CACHE_HOME), none the second time."""
    import higgs_engine.profile as profile_mod
    from higgs_cli.main import main

    cache = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    calls: list[int] = []
    real = profile_mod.compute_profile

    def counting(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(profile_mod, "compute_profile", counting)
    import higgs_engine.dynamic as dyn

    monkeypatch.setattr(dyn, "compute_profile", counting)
    args = ["--avg-bits", "3.5", "--profile-tokens", "32", "--profile-context", "16"]
    assert main(["quantize", str(llama_ckpt), "--out", str(tmp_path / "a"), *args]) == 0
    assert calls == [1]
    prof_dir = cache / "higgs" / "profiles"
    assert len(list(prof_dir.glob("profile-*.json"))) == 1
    assert len(list(prof_dir.glob("selfgen-*.safetensors"))) == 1
    assert main(["quantize", str(llama_ckpt), "--out", str(tmp_path / "b"), *args]) == 0
    assert calls == [1]  # the second run measured nothing
    rep = json.loads((tmp_path / "b" / "report.json").read_text())
    assert rep["metrics"]["profile"]["calibration"].startswith("self:")
