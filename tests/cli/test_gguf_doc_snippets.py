"""The llama-cpp-python snippets of docs/cli.md and README.md run as written, with llama.cpp's
defaults (what a user types), on a file `higgs quantize --format gguf --bits 4` wrote (Q4_K
tensors): the llama.cpp that scripts/setup builds must run the project's own files, decode
included, and without the CPU repack buffer (GGML_CPU_REPACK=OFF, scripts/install_llama_cpp),
which repacked these tensors into the layout whose AVX-512 kernels crashed. Each runs in a
fresh interpreter under a memory cap."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from higgs_cli.main import main
from tests.fixtures import build_gguf_llama

ROOT = Path(__file__).resolve().parents[2]
CAP = "--as=6442450944"  # 6 GiB of address space for the snippet's interpreter


def _snippets() -> list[str]:
    found = []
    for doc in (ROOT / "docs" / "cli.md", ROOT / "README.md"):
        for line in doc.read_text().splitlines():
            if line.startswith("python -c") and "llama_cpp" in line:
                found.append(line.split("  #")[0].strip())
    return found


def test_docs_have_a_llama_cpp_python_snippet() -> None:
    assert _snippets(), "docs/cli.md lost its llama-cpp-python snippet"


@pytest.fixture(scope="module")
def q4k_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("q4k")
    ckpt = build_gguf_llama(tmp / "tiny")
    out = tmp / "g4"
    assert (
        main(
            ["quantize", str(ckpt), "--out", str(out), "--format", "gguf", "--bits", "4", "--quiet"]
        )
        == 0
    )
    (gguf,) = (out / "gguf").glob("*.gguf")
    from higgs_engine.gguf.plan import read_gguf

    types = set(read_gguf([gguf], quantized=True).types.values())
    assert "Q4_K" in types, types
    return gguf


@pytest.mark.parametrize("snippet", _snippets())
def test_snippet_runs_as_written(snippet: str, q4k_file: Path, tmp_path: Path) -> None:
    # The file under the name the snippet uses, in the folder it runs in.
    (name,) = set(re.findall(r"[\w.-]+\.gguf", snippet))
    shutil.copy(q4k_file, tmp_path / name)
    cmd = snippet.replace("python -c", f"prlimit {CAP} {sys.executable} -c", 1)
    res = subprocess.run(
        cmd, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, f"{snippet!r} exited {res.returncode}:\n{res.stderr[-2000:]}"
    # Llama() logs its load (verbose by default): the build scripts/setup makes has no CPU
    # "repack" buffer, whose AVX-512 Q4_K kernels crashed decoding on some CPUs.
    assert "CPU_REPACK" not in res.stderr, "llama.cpp was built with GGML_CPU_REPACK on"
