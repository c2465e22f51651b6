"""`higgs serve` on an install that lacks an extra: one line naming the extra to install, no
traceback (from this process or a child it started)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Installed first thing in every Python process of the run (the serve command and any child it
# starts): imports of these top-level packages fail as they do where they are not installed.
BLOCKER = """
import importlib.abc, sys
BLOCKED = set({blocked!r})
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _NotInstalled())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def higgs_without(
    blocked: set[str], tmp_path: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(blocked)))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HIGGS_")}
    env = {**clean, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    cmd = [sys.executable, "-c", "import sys; from higgs_cli.main import main; sys.exit(main())"]
    proc = subprocess.Popen(
        [*cmd, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its children too can be stopped below
    )
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"higgs kept running instead of refusing to start: {stderr[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _serve(tmp_path: Path) -> list[str]:
    data = str(tmp_path / "data")
    return ["serve", "--data-dir", data, "--port", str(_free_port()), "--grace", "1"]


@pytest.mark.parametrize("args", [(), ("--no-api",)])
def test_serve_without_the_worker_extra_names_it_in_one_line(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    out = higgs_without({"torch", "transformers"}, tmp_path, *_serve(tmp_path), *args)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "ModuleNotFoundError" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("higgs: error:") and "higgs-service[worker]" in line, line
    assert "torch" in line and "--no-worker" in line, line


def test_serve_without_the_api_extra_names_it_in_one_line(tmp_path: Path) -> None:
    out = higgs_without({"fastapi", "uvicorn"}, tmp_path, *_serve(tmp_path), "--no-worker")
    assert out.returncode == 1, out.stdout + out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "higgs-service[api]" in line and "fastapi" in line, line


def test_other_verbs_name_the_missing_extra_too(tmp_path: Path) -> None:
    """`higgs keys list` needs the database libraries of the api extra."""
    out = higgs_without({"sqlalchemy"}, tmp_path, "keys", "list", "--data-dir", str(tmp_path))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "sqlalchemy" in line and "pip install 'higgs-service[api]'" in line, line
