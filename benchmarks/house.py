"""The code structure of two revisions side by side: lines per module (the largest 10), import
cycles (strongly connected components over every import, those inside functions included) and
cross-module private imports (`from x import _y`), over the shipped packages (higgs_engine, app,
worker, higgs_cli, migrations). The import graph is devtools/import_graph.py's, the one
tests/test_import_graph.py checks. A revision is read with `git archive REV | tar -x` into a
temporary folder (nothing is checked out); `worktree` is the working tree as it is.

Default: `ff19d23~1` (the house before its modules were split) against the working tree.
Writes benchmarks/results/house.json and .md.

    python -m benchmarks.house [--old REV] [--new REV|worktree] [--top 10]
"""

from __future__ import annotations

import argparse
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
    return {
        "modules": len(lines),
        "lines": sum(lines.values()),
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
            f"Measured {time.strftime('%Y-%m-%dT%H:%M:%S%z')}.",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="ff19d23~1", help="a git revision (default: ff19d23~1)")
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
