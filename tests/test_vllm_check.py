"""scripts/gpu_check's vLLM step (benchmarks/vllm_check.py) on a machine without vllm or CUDA:
one skip line saying which is missing, exit 0, nothing written. Where both are present the
step serves a quantized directory, which no test here can do."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_without_vllm_or_cuda_the_step_is_one_skip_line(tmp_path: Path) -> None:
    import torch

    if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available():
        pytest.skip("vllm and CUDA are both here: the step really runs (scripts/gpu_check)")
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.vllm_check", "--out-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm_check: skipped: "), done.stdout
    missing = "the vllm package" if importlib.util.find_spec("vllm") is None else "CUDA"
    assert missing in lines[0]
    assert not out.exists()
