"""The one import scanner of the repository, read statically from every import statement
(module level and inside functions alike).

    imported_modules  (line, module) of each absolute import of a file
    eager_imports     the imports a module runs when it is imported (module level only)
    names_used        every imported, referenced or attribute name of a file
    graph, cycles     which repository modules each module imports, the private names
                      (`from x import _y`) it takes from other modules, and the import cycles
                      (strongly connected components)

Every import test uses it: tests/test_import_graph.py (layers, cycles, private names),
tests/app/test_import_rules.py (the direction of imports, the API's torch-free closure),
tests/test_layout.py (where development code lives), tests/test_deploy_files.py (third-party
imports against the extras) and tests/engine/test_job.py (what the CLI and the worker call);
benchmarks/house.py measures any revision with it (a tree unpacked anywhere: `root`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = ("higgs_engine", "app", "worker", "higgs_cli", "migrations")


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def repo_module(root: Path, name: str) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def sources(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every .py file of the packages under `root` (a package the tree
    lacks contributes nothing)."""
    out = {}
    for pkg in packages:
        if (root / pkg).is_dir():
            for path in sorted((root / pkg).rglob("*.py")):
                out[module_name(root, path)] = path
    return out


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imported_modules(path: Path, root: Path | None = None) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in `path`, nested ones included: `import a.b`
    gives a.b; `from a.b import c` gives a.b, and a.b.c too when `root` holds such a module
    (`from higgs_engine.planning import plans` imports a submodule)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if root is not None:
                found += [
                    (node.lineno, f"{node.module}.{a.name}")
                    for a in node.names
                    if repo_module(root, f"{node.module}.{a.name}")
                ]
    return found


def eager_imports(path: Path, root: Path) -> list[str]:
    """The imports a module runs when it is imported: module level, not in a function, not
    under `if TYPE_CHECKING:` (submodules of `root` named by a `from` import included)."""
    found: list[str] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append(node.module)
                found.extend(
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if repo_module(root, f"{node.module}.{a.name}")
                )
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, (ast.Try, ast.With, ast.ClassDef)):
                visit(node.body)

    visit(_tree(path).body)
    return found


def names_used(path: Path) -> set[str]:
    """Every name `path` imports (`from x import name`), refers to, or reads as an attribute."""
    used: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            used |= {a.name for a in node.names}
        elif isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
    return used


def import_edges(root: Path, path: Path, me: str) -> tuple[set[str], set[tuple[str, str]]]:
    """(repo modules `path` imports anywhere in it, (module, name) of private names it imports
    from other repo modules)."""
    mods: set[str] = set()
    private: set[tuple[str, str]] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names if repo_module(root, a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: resolve against this module's package
                parts = me.split(".")
                keep = len(parts) - node.level + (1 if path.name == "__init__.py" else 0)
                pkg = parts[:keep]
                base = ".".join([*pkg, node.module])
            if not repo_module(root, base):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                if repo_module(root, sub):
                    mods.add(sub)
                else:
                    mods.add(base)
                    if a.name.startswith("_") and base != me:
                        private.add((base, a.name))
    mods.discard(me)
    return mods, private


def graph(
    root: Path, packages: tuple[str, ...] = PACKAGES
) -> tuple[dict[str, set[str]], set[tuple[str, str, str]]]:
    """(module -> repo modules it imports, (importer, module, name) of each private import)."""
    edges: dict[str, set[str]] = {}
    private: set[tuple[str, str, str]] = set()
    for name, path in sources(root, packages).items():
        mods, priv = import_edges(root, path, name)
        # importing a.b.c also runs a/__init__ and a/b/__init__; those are not cycles of c's
        edges[name] = {m for m in mods if not name.startswith(m + ".")}
        private |= {(name, mod, n) for mod, n in priv}
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def public_functions(path: Path) -> set[str]:
    """The module-level functions of the file at `path` whose names are public (no `_`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and not node.name.startswith("_")
    }


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` of a Name / Attribute chain, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def names_taken(root: Path, path: Path) -> set[tuple[str, str]]:
    """(repo module, name) for every name the file at `path` takes from another repo module,
    anywhere in it: `from m import name`, and `alias.name` where alias is a module imported
    whole (`import m`, `import m as alias`, `from pkg import m`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: dict[str, str] = {}  # local name -> module it stands for
    taken: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if repo_module(root, a.name):
                    modules[a.asname or a.name] = a.name
                    if a.asname is None:  # `import a.b` binds a; a.b.f is read as (a.b, f)
                        parts = a.name.split(".")
                        for i in range(1, len(parts)):
                            modules[".".join(parts[:i])] = ".".join(parts[:i])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if not repo_module(root, node.module):
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if repo_module(root, sub):
                    modules[a.asname or a.name] = sub
                else:
                    taken.add((node.module, a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = _dotted(node.value)
            if base is not None and base in modules:
                taken.add((modules[base], node.attr))
    return taken
