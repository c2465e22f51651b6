"""The house's shape, checked statically on every import statement of the shipped packages
(module level and inside functions alike): no module imports another module's private names
(`from x import _y`), and no package has an import cycle, hidden or not. An exception would be
listed below (and a listed one that no longer occurs fails too); there is none. The graph is
devtools/import_graph.py's (benchmarks/house.py measures other revisions with it)."""

from __future__ import annotations

from pathlib import Path

from devtools.import_graph import PACKAGES, cycles, graph

ROOT = Path(__file__).resolve().parents[1]

# Exceptions, each (importing module, imported module, name) / a set of modules: none.
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()
KNOWN_CYCLES: list[set[str]] = []


def test_no_private_names_across_modules() -> None:
    _, private = graph(ROOT, PACKAGES)
    assert sorted(private - KNOWN_PRIVATE) == [], "new private imports across modules"
    assert sorted(KNOWN_PRIVATE - private) == [], "fixed: remove these from KNOWN_PRIVATE"


def test_no_import_cycles() -> None:
    edges, _ = graph(ROOT, PACKAGES)
    found = cycles(edges)
    key = sorted(sorted(c) for c in found)
    assert key == sorted(sorted(c) for c in KNOWN_CYCLES)


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
