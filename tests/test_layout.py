"""Where development code lives: tests and benchmarks share helpers only through devtools/
(neither imports the other), the shipped packages import none of the three, test modules
import shared helpers from tests/fixtures.py and never from a conftest, and devtools/ is in
no installed package."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("app", "worker", "higgs_engine", "higgs_cli")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


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
