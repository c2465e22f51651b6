"""How often one run resolves its model, in two revisions side by side: the same `higgs
quantize` commands (benchmarks/identical.py's tiny checkpoints) run by each revision's own code,
with `sources.resolve_source` (a model reference found on disk or in the Hub cache),
`model_structure.load_config` (config.json read into a transformers config) and
`model_structure.build_meta_model` (the model built on the meta device) counted.

The counters wrap those three functions in their modules before anything else of the engine is
imported, so every later `from ... import` takes the wrapped one; a call through a name bound
before that would go uncounted, which no module of either revision does (they import these
lazily or after the engine's first import, which this script makes itself).

Default: `bd571b3` against the working tree. Writes benchmarks/results/resolutions.json and .md.

    python -m benchmarks.resolutions [--old REV] [--new REV|worktree]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import markdown_table, write_results
from benchmarks.house import WORKTREE
from benchmarks.identical import PROFILE, TEXT, build_checkpoints, quantize_command, tree_of

COUNTED = ("resolve_source", "load_config", "build_meta_model")
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "uniform 4 bits": ("llama", ["--bits", "4"]),
    "dynamic avg-bits 3.5": ("llama", ["--avg-bits", "3.5", *PROFILE]),
    "calibrated 4 bits": (
        "llama",
        ["--bits", "4", "--calibration", "TEXT", "--calibration-tokens", "1024"],
    ),
    "sharded source, dynamic": ("sharded", ["--avg-bits", "3.5", *PROFILE]),
}

# Run in the revision's tree before the CLI: wrap the counted functions; print the counts at
# exit.
COUNTER = """
import atexit, collections, json
import higgs_engine.sources as sources
import higgs_engine.model_structure as structure
counts = collections.Counter()
def wrap(module, name):
    inner = getattr(module, name)
    def counted(*a, **k):
        counts[name] += 1
        return inner(*a, **k)
    setattr(module, name, counted)
wrap(sources, "resolve_source")
wrap(structure, "load_config")
wrap(structure, "build_meta_model")
atexit.register(lambda: print("COUNTS " + json.dumps(dict(counts)), flush=True))
"""


def count(tree: Path, ckpt: Path, out: Path, args: list[str], work: Path) -> dict[str, int]:
    cmd, env = quantize_command(tree, ckpt, out, args, work, COUNTER)
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: quantize {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("COUNTS ")][-1]
    found = json.loads(line[len("COUNTS ") :])
    return {name: int(found.get(name, 0)) for name in COUNTED}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="bd571b3")
    ap.add_argument("--new", default=WORKTREE)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="resolutions-") as tmp_s:
        tmp = Path(tmp_s)
        ckpts = build_checkpoints(tmp / "ckpt")
        (tmp / "text.txt").write_text(TEXT)
        old_tree, old_label = tree_of(args.old, tmp)
        new_tree, new_label = tree_of(args.new, tmp)
        for name, (ckpt, cli) in CONFIGS.items():
            got = {}
            for side, tree in (("old", old_tree), ("new", new_tree)):
                work = tmp / f"{side}-{len(rows)}"
                work.mkdir()
                got[side] = count(tree, ckpts[ckpt], work / "out", cli, tmp)
            rows.append({"configuration": name, "command": " ".join(cli), **got})
    results = {"old": old_label, "new": new_label, "counted": list(COUNTED), "rows": rows}
    table = [
        {
            "configuration": r["configuration"],
            **{f"{side} {n}": r[side][n] for side in ("old", "new") for n in COUNTED},
        }
        for r in rows
    ]
    cols = [("configuration", "")] + [
        (f"{side} {n}", f"{side}: {n}") for side in ("old", "new") for n in COUNTED
    ]
    md = "\n".join(
        [
            "## Resolutions per run, before and after",
            "",
            f"`python -m benchmarks.resolutions`: old {old_label}, new {new_label}; each runs "
            "`higgs quantize` with its own code on the same tiny checkpoints "
            "(benchmarks/identical.py), counting calls of `sources.resolve_source`, "
            "`model_structure.load_config` and `model_structure.build_meta_model`.",
            "",
            markdown_table(table, cols),
            "",
            f"Measured {time.strftime('%Y-%m-%dT%H:%M:%S%z')}.",
        ]
    )
    write_results("resolutions", results, md)
    print(md)


if __name__ == "__main__":
    main()
