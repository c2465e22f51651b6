"""The direction of imports (docs/architecture.md), checked on every import statement in the repo,
including imports inside functions, plus a runtime check that the API never loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICE_LIBS = {
    "fastapi",
    "starlette",
    "sqlalchemy",
    "alembic",
    "celery",
    "kombu",
    "redis",
    "psycopg",
    "uvicorn",
    "pydantic_settings",
    "prometheus_client",
}
HEAVY = {"torch", "transformers", "safetensors", "huggingface_hub", "numpy", "gguf", "accelerate"}
# config and errors are pure Python; allocator, dynamic and profile (plans from a cached
# profile) need numpy but never torch: test_planning_never_loads_torch runs them.
APP_MAY_IMPORT_FROM_ENGINE = {
    "higgs_engine",
    "higgs_engine.config",
    "higgs_engine.errors",
    "higgs_engine.allocator",
    "higgs_engine.dynamic",
    "higgs_engine.profile",
}


def imports_of(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # `from higgs_engine import pipeline` imports a submodule too.
            found += [
                (node.lineno, f"{node.module}.{a.name}")
                for a in node.names
                if node.module == "higgs_engine"
            ]
    return found


def violations(package: str, allowed: Callable[[str], bool]) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imports_of(path):
            if not allowed(module):
                out.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return out


def top(module: str) -> str:
    return module.split(".")[0]


def test_engine_imports_no_service_code() -> None:
    banned = {"app", "worker", "higgs_cli"} | SERVICE_LIBS
    assert violations("higgs_engine", lambda m: top(m) not in banned) == []


def test_app_imports_neither_worker_nor_torch() -> None:
    def ok(m: str) -> bool:
        if top(m) in {"worker", "higgs_cli"} | HEAVY:
            return False
        if top(m) == "higgs_engine":
            # Only the torch-free modules above (and names from the package root that config
            # and errors provide).
            return m in APP_MAY_IMPORT_FROM_ENGINE or m in {
                "higgs_engine.HiggsConfig",
                "higgs_engine.HiggsError",
            }
        return True

    assert violations("app", ok) == []


def test_import_scanner_sees_nested_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    import torch\n    from worker.runner import run\n")
    assert [m for _, m in imports_of(f)] == ["torch", "worker.runner"]


@pytest.mark.parametrize(
    "module", ["app.main", "app.jobs.state", "app.db.models", "app.settings", "app.plans.service"]
)
def test_api_process_never_loads_torch(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in ('torch', 'transformers', 'worker', 'safetensors') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr


def test_planning_never_loads_torch() -> None:
    """POST /v1/plans runs the allocator in the API process: numpy yes, torch never."""
    code = (
        "import sys\n"
        "from app.plans.planner import compute_plan\n"
        "layers = [{'name': f'l{i}', 'shape': [64, 128], 'alpha': 0.1 * (i + 1), 'points': [],"
        " 'tr_fisher': None} for i in range(4)]\n"
        "prof = {'model': 'm', 'revision': 'r', 'calibration': 'random:0', 'config': {'metric': 'kl',"
        " 'method': 'noise', 'levels': [0.005, 0.02], 'context': 8, 'windows': 1, 'seed': 0,"
        " 'fisher_samples': 4}, 'layers': layers, 'base': {}, 'cost': {}, 'complete': True,"
        " 'version': 1}\n"
        "plan = compute_plan(prof, {'avg_bits': 4.0}, resolution=1e-3)\n"
        "assert plan['allocation']['avg_bits'] <= 4.0 and plan['pareto'], plan\n"
        "bad = sorted(m for m in ('torch', 'transformers', 'worker', 'safetensors') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
