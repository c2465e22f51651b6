"""Progress names its unit: every stage the engine and the worker report has its unit in the
one table (higgs_engine.planning.stages), which the CLI's bars, the API and the console read."""

from __future__ import annotations

import ast
from pathlib import Path

from higgs_engine.planning.stages import STAGE_UNITS, stage_unit
from higgs_engine.progress import STAGES

ROOT = Path(__file__).resolve().parents[1]


def emitted_stages(package: str, root: Path = ROOT) -> dict[str, str]:
    """stage -> where, for every stage named by a string literal in a progress call of
    `package`: report(progress, "stage", ...), writer("stage", ...), progress("stage", ...)."""
    found: dict[str, str] = {}
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            pos = {"report": 1, "writer": 0, "progress": 0}.get(name)
            if pos is None or len(node.args) <= pos:
                continue
            arg = node.args[pos]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.setdefault(arg.value, f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_emitted_stage_has_its_unit() -> None:
    emitted = {**emitted_stages("higgs_engine"), **emitted_stages("worker")}
    # the scan sees the engine's and the worker's stages
    assert {"generating", "profiling", "probing", "measuring", "quantizing"} <= set(emitted)
    assert {"uploading", "resolving"} <= set(emitted)
    unknown = {s: where for s, where in emitted.items() if s not in STAGE_UNITS}
    assert unknown == {}
    assert tuple(STAGE_UNITS) == STAGES


def test_units_say_what_is_counted() -> None:
    assert stage_unit("generating") == "token"
    assert stage_unit("profiling") == "window"
    assert stage_unit("probing") == "layer"
    assert stage_unit("quantizing") == "layer"
    assert stage_unit("measuring") == "tensor"
    assert stage_unit("uploading") == "file"
    assert stage_unit("packaging") == "step"
    assert stage_unit("something-new") == "step" and stage_unit(None) is None


def test_the_scan_sees_a_stage(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f(p, w):\n    report(p, 'x1', 0, 1)\n    w('x2', 0, 1)\n")
    assert set(emitted_stages("pkg", tmp_path)) == {"x1"}  # w(...): no progress call by name
