"""The direction of imports (docs/architecture.md), checked on every import statement in the repo,
including imports inside functions, plus a runtime check that the API never loads torch."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from devtools import import_graph
from devtools.import_graph import imported_modules

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
# What the API process must never load: the torch stack (numpy is allowed to the planning part,
# higgs_engine/planning/__init__.py says why).
TORCH_STACK = HEAVY - {"numpy"}
# The engine modules app/ may import: the torch-free planning part, and the typed errors.
APP_ENGINE_PREFIX = "higgs_engine.planning"
APP_ENGINE_EXTRA = {"higgs_engine.errors"}
# The planning part's own imports: itself, the engine's pure-Python leaf modules, numpy.
PLANNING_MAY_IMPORT = {"higgs_engine.errors", "higgs_engine.progress", "higgs_engine.report"}


def imports_of(path: Path) -> list[tuple[int, str]]:
    return imported_modules(path, ROOT)


def module_file(module: str) -> Path | None:
    """The source file of a repo module (a package's __init__.py), None for anything else."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def eager_imports(path: Path) -> list[str]:
    return import_graph.eager_imports(path, ROOT)


def engine_closure(modules: set[str]) -> set[str]:
    """Every higgs_engine module that importing `modules` can run, followed transitively: all
    of their own imports (nested ones included), plus the packages above each on the way, of
    which only what runs on import counts (the package root's lazy `quantize_checkpoint`
    attribute loads the pipeline only when someone asks for it, and app/ never does: it may
    not import from the package root at all)."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        mod = todo.pop()
        if mod in seen or module_file(mod) is None:
            continue
        seen.add(mod)
        todo += [m for _, m in imports_of(module_file(mod)) if top(m) == "higgs_engine"]  # type: ignore[arg-type]
        parts = mod.split(".")
        for k in range(1, len(parts)):
            pkg = ".".join(parts[:k])
            todo += [m for m in eager_imports(module_file(pkg)) if top(m) == "higgs_engine"]  # type: ignore[arg-type]
    return seen


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


def app_engine_ok(module: str) -> bool:
    return module.startswith(APP_ENGINE_PREFIX) or module in APP_ENGINE_EXTRA


def test_app_imports_neither_worker_nor_torch() -> None:
    def ok(m: str) -> bool:
        if top(m) in {"worker", "higgs_cli"} | HEAVY:
            return False
        if top(m) == "higgs_engine":
            return app_engine_ok(m)
        return True

    assert violations("app", ok) == []


def engine_modules_app_imports() -> set[str]:
    return {
        m
        for path in (ROOT / "app").rglob("*.py")
        for _, m in imports_of(path)
        if top(m) == "higgs_engine" and module_file(m) is not None
    }


def test_engine_modules_the_app_reaches_import_no_torch_anywhere() -> None:
    """Static, not only at runtime: no module the API can reach through its engine imports
    has a torch-stack import in it, not even inside a function or under TYPE_CHECKING."""
    reached = engine_closure(engine_modules_app_imports())
    assert "higgs_engine.planning.plans" in reached  # the scan follows what app imports
    bad = [
        f"{mod} imports {m} (line {line})"
        for mod in sorted(reached)
        for line, m in imports_of(module_file(mod))  # type: ignore[arg-type]
        if top(m) in TORCH_STACK
    ]
    assert bad == []


def test_planning_imports_only_planning_and_pure_leaves() -> None:
    def ok(m: str) -> bool:
        if top(m) == "higgs_engine":
            return m.startswith(APP_ENGINE_PREFIX) or m in PLANNING_MAY_IMPORT | {"higgs_engine"}
        return top(m) not in TORCH_STACK

    assert violations("higgs_engine/planning", ok) == []


def test_closure_scan_flags_the_torch_part() -> None:
    """The check above can fail: reaching the dynamic entry point (profiling, quantizing) is
    reported, through modules that import torch only inside functions."""
    reached = engine_closure({"higgs_engine.dynamic"})
    torch_users = {
        mod
        for mod in reached
        for _, m in imports_of(module_file(mod))  # type: ignore[arg-type]
        if top(m) in TORCH_STACK
    }
    assert {"higgs_engine.dynamic", "higgs_engine.profile"} <= torch_users


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
