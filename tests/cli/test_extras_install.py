"""`pip install ".[compressed-tensors]"` alone writes the format, and `pip install ".[gguf]"`
alone writes GGUF: the project installed (not editable) with one extra into a fresh virtual
environment, beside the tested torch, writes a tiny checkpoint with `higgs quantize`, checked by
transformers or llama.cpp. For GGUF no converter is laid out beforehand: the first job fetches
llama-cpp-python's source distribution with pip and takes the converter from it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import build_gguf_llama, build_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
# slow: a fresh virtual environment with torch, transformers and the library installed
pytestmark = pytest.mark.slow


def _pip(venv: Path, *args: str, env: dict[str, str] | None = None) -> None:
    res = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]


def _fresh_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A new virtual environment with the tested torch, and a copy of the tracked files."""
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
    return venv, src


def test_the_compressed_tensors_extra_alone_writes_the_format(tmp_path: Path) -> None:
    venv, src = _fresh_venv(tmp_path)
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


def _llama_cpp_build() -> Path:
    """The folder where scripts/setup keeps the llama-cpp-python wheel it built (and the source
    distribution it built it from): pip takes the wheel from there instead of building again."""
    mark = Path(sys.prefix) / "share" / "higgs-service" / "llama-cpp-wheel"
    if not mark.is_file():
        pytest.skip("no llama-cpp-python wheel built by scripts/setup")
    return Path(mark.read_text().strip()).parent


def test_the_gguf_extra_alone_writes_the_format(tmp_path: Path) -> None:
    build = _llama_cpp_build()
    venv, src = _fresh_venv(tmp_path)
    env = {
        **os.environ,
        "PIP_FIND_LINKS": str(build),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # no converter from an earlier run
        "HF_HUB_OFFLINE": "1",
    }
    _pip(venv, f"{src}[gguf]", env=env)
    assert not (venv / "share" / "higgs-service" / "llama.cpp").exists()
    ckpt = build_gguf_llama(tmp_path / "tiny")
    out = tmp_path / "out"
    res = subprocess.run(
        [str(venv / "bin" / "higgs"), "quantize", str(ckpt), "--out", str(out), "--format",
         "gguf", "--bits", "4", "--quiet"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    (gguf,) = (out / "gguf").glob("*.gguf")
    assert [gguf.name] == [Path(f).name for f in rep["metrics"]["gguf_files"]]
    # llama.cpp in the fresh environment loads the file and runs a token through it
    probe = (
        "import sys; from llama_cpp import Llama; m = Llama(sys.argv[1], verbose=False, "
        "n_ctx=32); m.eval([1]); print(m.n_vocab())"
    )
    loaded = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe, str(gguf)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert int(loaded.stdout.strip().splitlines()[-1]) > 0
    # the converter was laid out in the user's cache, for the installed version
    version = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "from importlib.metadata import version; print(version('llama-cpp-python'))"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.strip()  # fmt: skip
    conv = tmp_path / "cache" / "higgs-service" / "llama-cpp-converter" / version
    assert (conv / "convert_hf_to_gguf.py").is_file()
    assert (conv / "VERSION").read_text().strip() == version
