"""The house's shape, checked statically on every import statement of the shipped packages
(module level and inside functions alike): no module imports another module's private names
(`from x import _y`), and no package has an import cycle, hidden or not. An exception would be
listed below (and a listed one that no longer occurs fails too); there is none. Inside the engine,
modules import downward through the layers of ENGINE_LAYERS (docs/architecture.md), and every
engine module has its layer. The graph is devtools/import_graph.py's (benchmarks/house.py
measures other revisions with it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from devtools.import_graph import PACKAGES, cycles, graph

ROOT = Path(__file__).resolve().parents[1]

# Exceptions, each (importing module, imported module, name) / a set of modules: none.
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()
KNOWN_CYCLES: list[set[str]] = []

# higgs_engine's layers, lowest first: a module imports its own layer or lower ones, never a
# higher one. A name stands for the module and, unless a longer name claims them, its
# submodules. A new engine module must be placed here (the test says which is unplaced).
ENGINE_LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("errors", "progress", "report", "device", "planning")),
    (
        "primitives",
        (
            "hadamard",
            "grids",
            "grid_build",
            "scale_search",
            "packing",
            "nearest",
            "quantize",
            "gptq",
            "baselines",
            "modules",
        ),
    ),
    ("methods", ("methods",)),
    (
        "model I/O",
        (
            "sources",
            "safetensors_stream",
            "checkpoint_check",
            "artifact_check",
            "model_structure",
            "model_loading",
            "formats",
            "artifacts",
            "output",
            "evaluate",
            "selfgen",
            "profile",
        ),
    ),
    ("run core", ("run_core",)),
    ("orchestrators", ("parts", "pipeline", "calibration", "dynamic", "gguf", "ct")),
    ("entry point", ("job",)),
]


def engine_layer(module: str, layers: Sequence[tuple[str, tuple[str, ...]]]) -> int | None:
    """The index of `module`'s layer (the longest matching name wins), or None."""
    best: tuple[int, int] | None = None
    for i, (_, names) in enumerate(layers):
        for name in names:
            full = f"higgs_engine.{name}"
            if (module == full or module.startswith(full + ".")) and (
                best is None or len(full) > best[1]
            ):
                best = (i, len(full))
    return None if best is None else best[0]


def upward_imports(
    edges: dict[str, set[str]], layers: Sequence[tuple[str, tuple[str, ...]]]
) -> tuple[list[str], list[str]]:
    """(engine modules without a layer, "a (layer) -> b (layer)" for every import of a higher
    layer), over the engine's modules (the package's own __init__ aside)."""
    unplaced: list[str] = []
    upward: list[str] = []
    for mod in sorted(edges):
        if not mod.startswith("higgs_engine."):
            continue
        mine = engine_layer(mod, layers)
        if mine is None:
            unplaced.append(mod)
            continue
        for dep in sorted(edges[mod]):
            theirs = engine_layer(dep, layers) if dep.startswith("higgs_engine.") else None
            if theirs is not None and theirs > mine:
                upward.append(f"{mod} ({layers[mine][0]}) -> {dep} ({layers[theirs][0]})")
    return unplaced, upward


def test_no_private_names_across_modules() -> None:
    _, private = graph(ROOT, PACKAGES)
    assert sorted(private - KNOWN_PRIVATE) == [], "new private imports across modules"
    assert sorted(KNOWN_PRIVATE - private) == [], "fixed: remove these from KNOWN_PRIVATE"


def test_no_import_cycles() -> None:
    edges, _ = graph(ROOT, PACKAGES)
    found = cycles(edges)
    key = sorted(sorted(c) for c in found)
    assert key == sorted(sorted(c) for c in KNOWN_CYCLES)


def test_engine_modules_import_down_the_layers() -> None:
    edges, _ = graph(ROOT, ("higgs_engine",))
    unplaced, upward = upward_imports(edges, ENGINE_LAYERS)
    assert unplaced == [], "engine modules without a layer: add them to ENGINE_LAYERS"
    assert upward == [], "imports of a higher layer"


def test_layer_check_sees_an_upward_import_and_an_unplaced_module() -> None:
    layers = [("low", ("quantize",)), ("high", ("job",))]
    edges = {
        "higgs_engine.quantize": {"higgs_engine.job"},
        "higgs_engine.job": {"higgs_engine.quantize"},
        "higgs_engine.stray": set(),
    }
    unplaced, upward = upward_imports(edges, layers)
    assert unplaced == ["higgs_engine.stray"]
    assert upward == ["higgs_engine.quantize (low) -> higgs_engine.job (high)"]


def test_cycle_finder_sees_a_hidden_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_reads_a_tree_anywhere(tmp_path: Path) -> None:
    # A cycle hidden in a function-level import, a relative import and a private name.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import helper\n_secret = 1\n")
    (tmp_path / "pkg" / "b.py").write_text(
        "def helper():\n    from .a import _secret\n    return _secret\n"
    )
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    edges, private = graph(tmp_path, ("pkg", "absent"))
    assert edges == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert private == {("pkg.b", "pkg.a", "_secret")}
    assert cycles(edges) == [{"pkg.a", "pkg.b"}]
