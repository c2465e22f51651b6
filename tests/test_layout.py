"""Where development code lives: tests and benchmarks share helpers only through devtools/
(neither imports the other), the shipped packages import none of the three, test modules
import shared helpers from tests/fixtures.py and never from a conftest, devtools/ is in no
installed package, and the benchmarks run as modules (`python -m benchmarks.<name>` from the
repository root) without editing sys.path."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from devtools.import_graph import imported_modules

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("app", "worker", "higgs_engine", "higgs_cli")


def offenders(folder: str, bad: set[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, module in imported_modules(path)
        if module.split(".")[0] in bad
    ]


def test_tests_do_not_import_benchmarks() -> None:
    assert offenders("tests", {"benchmarks"}) == []


def test_benchmarks_do_not_import_tests() -> None:
    # `common` was the benchmarks' folder imported by a bare name; devtools/ is the shared place.
    assert offenders("benchmarks", {"tests", "common"}) == []


BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")


def test_benchmarks_leave_sys_path_alone() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in sorted((ROOT / "benchmarks").rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bsys\.path\b", line)
    ]
    assert found == []


def test_benchmarks_import_as_modules_without_running() -> None:
    # In a fresh interpreter started at the repository root, as `python -m benchmarks.<name>`
    # would be (the test process keeps none of it): every module imports, none prints, changes
    # sys.path or runs its main(), and `gguf` is llama.cpp's gguf-py, not benchmarks/gguf.py.
    code = (
        "import importlib, json, sys\n"
        "before = list(sys.path)\n"
        f"for name in {BENCHMARKS!r}:\n"
        "    importlib.import_module('benchmarks.' + name)\n"
        "import gguf\n"
        "print(json.dumps({'same_path': sys.path == before, 'gguf': gguf.__file__}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout[-2000:]
    result = json.loads(lines[0])
    assert result["same_path"]
    assert Path(result["gguf"]).parent.name == "gguf"
    assert not Path(result["gguf"]).is_relative_to(ROOT / "benchmarks")


def test_benchmark_usage_lines_run_modules() -> None:
    old = re.compile(r"python3? +benchmarks/")
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in [
            *sorted((ROOT / "benchmarks").glob("*.py")),
            ROOT / "README.md",
            ROOT / "benchmarks" / "README.md",
            *sorted((ROOT / "docs").glob("*.md")),
            ROOT / "scripts" / "gpu_check",
        ]
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if old.search(line)
    ]
    assert BENCHMARKS and found == []


def test_devtools_import_neither_tests_nor_benchmarks() -> None:
    assert offenders("devtools", {"tests", "benchmarks"}) == []


def test_shipped_packages_import_no_development_code() -> None:
    for package in SHIPPED:
        assert offenders(package, {"tests", "benchmarks", "devtools"}) == [], package


def test_no_test_module_imports_a_conftest() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for line, module in imported_modules(path)
        if module.split(".")[-1] == "conftest"
    ]
    assert found == []


def test_devtools_is_not_packaged() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    dev = ("devtools", "tests", "benchmarks")
    assert not any(pattern.startswith(dev) for pattern in include), include
    assert set(SHIPPED) <= {pattern.rstrip("*") for pattern in include}
    assert not (ROOT / "app" / "db" / "scratch.py").exists()


def test_scanner_sees_a_nested_import(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from benchmarks.common import fmt\n")
    assert [m for _, m in imported_modules(f)] == ["benchmarks.common"]


@pytest.mark.parametrize("package", ["higgs_cli.main", "worker.celery_app"])
def test_cli_and_worker_wait_passively_unless_told_otherwise(package: str) -> None:
    # Set before torch loads its OpenMP runtime (it reads the policy once); a value in the
    # environment is kept.
    code = f"import os, {package}; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "PASSIVE", out.stderr[-500:]
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "ACTIVE", out.stderr[-500:]
