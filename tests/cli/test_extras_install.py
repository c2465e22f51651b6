"""`pip install ".[compressed-tensors]"` alone writes the format: the project installed (not
editable) with that extra into a fresh virtual environment, beside the tested torch, writes a
tiny checkpoint as compressed-tensors with `higgs quantize`, checked by transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import build_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
# slow: a fresh virtual environment with torch, transformers and the library installed
pytestmark = pytest.mark.slow


def _pip(venv: Path, *args: str) -> None:
    res = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]


def test_the_compressed_tensors_extra_alone_writes_the_format(tmp_path: Path) -> None:
    import torch

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # the tested torch first, as scripts/setup does (a bare requirement could pull another build)
    _pip(venv, f"torch=={torch.__version__.split('+')[0]}")
    src = tmp_path / "src"  # the tracked files only: no venv, prepared data or build leftovers
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    _pip(venv, f"{src}[compressed-tensors]")
    ckpt = build_tiny_checkpoint("llama", tmp_path / "tiny")
    out = tmp_path / "out"
    res = subprocess.run(
        [str(venv / "bin" / "higgs"), "quantize", str(ckpt), "--out", str(out), "--format",
         "compressed-tensors", "--bits", "4", "--quiet"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["metrics"]["load_check"]["class"] == "LlamaForCausalLM"
    assert (out / "compressed-tensors" / "config.json").is_file()
