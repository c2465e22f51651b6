"""The code structure of two revisions side by side: lines per module (the largest 10), import
cycles (strongly connected components over every import, those inside functions included) and
cross-module private imports (`from x import _y`), functions over 8 parameters or 80 lines and
modules over 600 lines, over the shipped packages (higgs_engine, app,
worker, higgs_cli, migrations). The import graph is devtools/import_graph.py's, the one
tests/test_import_graph.py checks. A revision is read with `git archive REV | tar -x` into a
temporary folder (nothing is checked out); `worktree` is the working tree as it is.

Default: `bd571b3` (the house before the one path from request to artifact) against the
working tree.
Writes benchmarks/results/house.json and .md.

    python -m benchmarks.house [--old REV] [--new REV|worktree] [--top 10]
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import markdown_table, write_results
from devtools.import_graph import PACKAGES, cycles, graph, sources

ROOT = Path(__file__).resolve().parent.parent
WORKTREE = "worktree"


def unpack(rev: str, dest: Path) -> str:
    """Unpack revision `rev` into `dest` (git archive | tar -x); returns its full commit id."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", commit], cwd=ROOT, stdout=subprocess.PIPE)
    tar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout)
    if archive.stdout is not None:
        archive.stdout.close()
    if archive.wait() != 0 or tar.returncode != 0:
        raise SystemExit(f"cannot unpack {rev!r} ({commit}) with git archive | tar -x")
    return commit


MAX_PARAMS = 8  # a function with more is asking for an object
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (1 if names and names[0].arg in ("self", "cls") else 0)


def functions(files: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """Functions over MAX_PARAMS parameters (self / cls not counted) and over
    MAX_FUNCTION_LINES lines (def to last line), module by module."""
    many: list[dict[str, Any]] = []
    long: list[dict[str, Any]] = []
    for name, path in sorted(files.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            where = f"{name}.{node.name}"
            if _params(node) > MAX_PARAMS:
                many.append({"function": where, "params": _params(node)})
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                long.append({"function": where, "lines": length})
    return {"many_params": many, "long": long}


def measure(root: Path, top: int) -> dict[str, Any]:
    """The structure of the tree at `root`."""
    files = sources(root, PACKAGES)
    lines = {name: len(path.read_text().splitlines()) for name, path in files.items()}
    edges, private = graph(root, PACKAGES)
    found = sorted((sorted(c) for c in cycles(edges)), key=lambda c: (-len(c), c))
    largest = sorted(lines.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    per_package = {
        pkg: {
            "modules": sum(1 for m in lines if m.split(".")[0] == pkg),
            "lines": sum(n for m, n in lines.items() if m.split(".")[0] == pkg),
        }
        for pkg in PACKAGES
    }
    funcs = functions(files)
    return {
        "modules": len(lines),
        "lines": sum(lines.values()),
        "functions_over_8_params": funcs["many_params"],
        "functions_over_80_lines": funcs["long"],
        "modules_over_600_lines": sorted(m for m, n in lines.items() if n > MAX_MODULE_LINES),
        "per_package": per_package,
        "largest": [{"module": m, "lines": n} for m, n in largest],
        "import_edges": sum(len(v) for v in edges.values()),
        "import_cycles": len(found),
        "modules_in_cycles": sum(len(c) for c in found),
        "cycles": found,
        "private_imports": len(private),
        "private_import_list": [
            {"importer": a, "module": b, "name": n} for a, b, n in sorted(private)
        ],
    }


def revision(rev: str, tmp: Path, top: int) -> dict[str, Any]:
    if rev == WORKTREE:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *PACKAGES],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        label = f"working tree (HEAD {head[:9]}{', with changes' if dirty else ''})"
        return {"rev": rev, "commit": head, "label": label, **measure(ROOT, top)}
    commit = unpack(rev, tmp / rev.replace("/", "_").replace("~", "_"))
    root = tmp / rev.replace("/", "_").replace("~", "_")
    return {"rev": rev, "commit": commit, "label": f"{rev} ({commit[:9]})", **measure(root, top)}


ENGINE_WORKER = ("higgs_engine", "worker")


def _in(rows: list[dict[str, Any]], packages: tuple[str, ...]) -> int:
    return sum(1 for r in rows if r["function"].split(".")[0] in packages)


def _listing(d: dict[str, Any]) -> list[str]:
    many = ", ".join(f"`{r['function']}` {r['params']}" for r in d["functions_over_8_params"])
    long = ", ".join(f"`{r['function']}` {r['lines']}" for r in d["functions_over_80_lines"])
    big = ", ".join(f"`{m}`" for m in d["modules_over_600_lines"])
    return [
        f"- over {MAX_PARAMS} parameters: {many or 'none'}",
        f"- over {MAX_FUNCTION_LINES} lines: {long or 'none'}",
        f"- modules over {MAX_MODULE_LINES} lines: {big or 'none'}",
    ]


def markdown(old: dict[str, Any], new: dict[str, Any], top: int) -> str:
    rows = [
        {"what": "modules", "old": old["modules"], "new": new["modules"]},
        {"what": "lines", "old": old["lines"], "new": new["lines"]},
        {
            "what": "largest module, lines",
            "old": old["largest"][0]["lines"],
            "new": new["largest"][0]["lines"],
        },
        {
            "what": f"functions over {MAX_PARAMS} parameters (engine and worker)",
            "old": _in(old["functions_over_8_params"], ENGINE_WORKER),
            "new": _in(new["functions_over_8_params"], ENGINE_WORKER),
        },
        {
            "what": f"functions over {MAX_PARAMS} parameters (all packages)",
            "old": len(old["functions_over_8_params"]),
            "new": len(new["functions_over_8_params"]),
        },
        {
            "what": f"functions over {MAX_FUNCTION_LINES} lines (engine and worker)",
            "old": _in(old["functions_over_80_lines"], ENGINE_WORKER),
            "new": _in(new["functions_over_80_lines"], ENGINE_WORKER),
        },
        {
            "what": f"functions over {MAX_FUNCTION_LINES} lines (all packages)",
            "old": len(old["functions_over_80_lines"]),
            "new": len(new["functions_over_80_lines"]),
        },
        {
            "what": f"modules over {MAX_MODULE_LINES} lines",
            "old": len(old["modules_over_600_lines"]),
            "new": len(new["modules_over_600_lines"]),
        },
        {
            "what": "import edges between modules",
            "old": old["import_edges"],
            "new": new["import_edges"],
        },
        {
            "what": "import cycles (SCCs of 2+ modules)",
            "old": old["import_cycles"],
            "new": new["import_cycles"],
        },
        {
            "what": "modules in a cycle",
            "old": old["modules_in_cycles"],
            "new": new["modules_in_cycles"],
        },
        {
            "what": "cross-module private imports",
            "old": old["private_imports"],
            "new": new["private_imports"],
        },
    ]
    cols = [("what", ""), ("old", old["label"]), ("new", new["label"])]
    pkg_rows = [
        {
            "package": pkg,
            "old": f"{old['per_package'][pkg]['modules']} / {old['per_package'][pkg]['lines']}",
            "new": f"{new['per_package'][pkg]['modules']} / {new['per_package'][pkg]['lines']}",
        }
        for pkg in PACKAGES
    ]
    largest = [
        {
            "rank": i + 1,
            "old": f"`{a['module']}` {a['lines']}" if a else "-",
            "new": f"`{b['module']}` {b['lines']}" if b else "-",
        }
        for i, (a, b) in enumerate(
            zip(
                old["largest"] + [None] * (top - len(old["largest"])),
                new["largest"] + [None] * (top - len(new["largest"])),
                strict=True,
            )
        )
    ]
    cycle_lines = [
        f"- {side}: "
        + (
            "none"
            if not d["cycles"]
            else "; ".join(
                f"{len(c)} modules ({', '.join(c[:4])}{', ...' if len(c) > 4 else ''})"
                for c in d["cycles"]
            )
        )
        for side, d in (("old", old), ("new", new))
    ]
    return "\n".join(
        [
            "## Code structure of two revisions: modules, import cycles, private imports",
            "",
            f"Packages {', '.join(PACKAGES)}; every import statement counts, module level or "
            "inside a function (devtools/import_graph.py, the graph tests/test_import_graph.py "
            "checks). Lines are physical lines of each .py file.",
            "",
            markdown_table(rows, cols),
            "",
            "Modules / lines per package:",
            "",
            markdown_table(pkg_rows, [("package", "package"), ("old", "old"), ("new", "new")]),
            "",
            f"The {top} largest modules (lines):",
            "",
            markdown_table(largest, [("rank", "#"), ("old", "old"), ("new", "new")]),
            "",
            "Import cycles:",
            "",
            *cycle_lines,
            "",
            f"Old ({old['label']}), functions and modules over the limits:",
            "",
            *_listing(old),
            "",
            f"New ({new['label']}):",
            "",
            *_listing(new),
            "",
            f"Measured {time.strftime('%Y-%m-%dT%H:%M:%S%z')}.",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="bd571b3", help="a git revision (default: bd571b3)")
    ap.add_argument(
        "--new", default=WORKTREE, help=f"a git revision, or {WORKTREE!r} (the default)"
    )
    ap.add_argument("--top", type=int, default=10, help="how many of the largest modules")
    ap.add_argument("--name", default="house", help="results file stem")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="house-") as tmp:
        old = revision(args.old, Path(tmp), args.top)
        new = revision(args.new, Path(tmp), args.top)
    payload = {"packages": list(PACKAGES), "old": old, "new": new}
    md = markdown(old, new, args.top)
    json_path, md_path = write_results(args.name, payload, md)
    print(md)
    print(f"\nwrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
