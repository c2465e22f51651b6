"""GGUF files and report.json of two revisions, byte for byte: `higgs quantize --format gguf`
run by each revision's own code on the same tiny llama checkpoint (the old revision's
tests/fixtures.py build_gguf_llama, random weights with seed 0, built once) for --bits 4, --ftype Q4_K_M, --avg-bits 5.5 and
--avg-bits 5.5 --rotate auto (the data-free profile on random tokens, measured by each revision
into its own cache). The old revision is read with `git archive REV | tar -x` into a temporary
folder (as benchmarks/house.py does) and run with that folder first on PYTHONPATH; `worktree`
is the working tree as it is.

Compared: the sha256 of every GGUF file, and report.json less what differs between any two runs
(`timings`, and the output path nowhere else appears in it).

    python -m benchmarks.gguf_identical [--old REV] [--new REV|worktree]

Writes benchmarks/results/gguf_identical.json and .md; exits 1 when anything differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import markdown_table, write_results
from benchmarks.house import WORKTREE, unpack

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ["--profile-random-tokens", "--profile-tokens", "64", "--profile-context", "32"]
CONFIGS = {
    "bits 4": ["--bits", "4"],
    "ftype Q4_K_M": ["--ftype", "Q4_K_M"],
    "avg-bits 5.5": ["--avg-bits", "5.5", *PROFILE],
    "avg-bits 5.5, rotate auto": ["--avg-bits", "5.5", "--rotate", "auto", *PROFILE],
}
# What differs between two runs of the same code: the seconds of each stage.
UNSTABLE = ("timings",)


def run_config(code: Path, ckpt: Path, args: list[str], work: Path) -> dict[str, Any]:
    """`higgs quantize` of revision `code` into `work`/out: sha256 per GGUF file and the
    comparable part of report.json."""
    out = work / "out"
    env = {**os.environ, "PYTHONPATH": str(code)}
    cmd = [sys.executable, "-m", "higgs_cli.main", "quantize", str(ckpt), "--out", str(out)]
    cmd += ["--format", "gguf", "--quiet", "--profile-cache", str(work / "cache"), *args]
    proc = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    for key in UNSTABLE:
        report.pop(key, None)
    return {
        "files": {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((out / "gguf").glob("*.gguf"))
        },
        "report_sha256": hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest(),
        "report": report,
    }


def build_checkpoint(code: Path, dest: Path) -> Path:
    """The tiny llama of the old revision's tests/fixtures.py (seed 0), built in a process of
    its own (the benchmarks import nothing of tests/)."""
    snippet = (
        "import sys; from pathlib import Path; from tests.fixtures import build_gguf_llama; "
        "build_gguf_llama(Path(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(code)}
    subprocess.run([sys.executable, "-c", snippet, str(dest)], env=env, cwd=code, check=True)
    return dest


def _code(rev: str, tmp: Path) -> tuple[Path, str]:
    if rev == WORKTREE:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        return ROOT, f"working tree (HEAD {head[:9]})"
    dest = tmp / "old"
    commit = unpack(rev, dest)
    return dest, f"{rev} ({commit[:9]})"


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON values differ (dotted paths, at most a few)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        return out
    return [] if a == b else [path]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="bd571b3")
    ap.add_argument("--new", default=WORKTREE)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gguf-identical-") as t:
        tmp = Path(t)
        old_code, old_label = _code(args.old, tmp)
        new_code, new_label = _code(args.new, tmp)
        ckpt = build_checkpoint(old_code, tmp / "tiny-llama")
        rows = []
        for name, flags in CONFIGS.items():
            slug = name.replace(" ", "_").replace(",", "")
            old = run_config(old_code, ckpt, flags, tmp / f"old-{slug}")
            new = run_config(new_code, ckpt, flags, tmp / f"new-{slug}")
            rows.append(
                {
                    "config": name,
                    "flags": " ".join(flags),
                    "gguf_files": len(new["files"]),
                    "gguf_sha256": next(iter(new["files"].values()))[:16],
                    "bits_per_weight": new["report"]["bits_per_weight"],
                    "rotated": new["report"]["metrics"].get("rotated"),
                    "predicted_change": new["report"]["metrics"].get("predicted_change"),
                    "gguf_identical": old["files"] == new["files"],
                    "report_identical": old["report"] == new["report"],
                    "report_differs_at": _diff(old["report"], new["report"])[:5],
                    "old": {k: v for k, v in old.items() if k != "report"},
                    "new": {k: v for k, v in new.items() if k != "report"},
                }
            )
    same = all(r["gguf_identical"] and r["report_identical"] for r in rows)
    payload = {"old": old_label, "new": new_label, "identical": same, "rows": rows}
    cols = [
        ("config", "configuration"),
        ("bits_per_weight", "bits per weight"),
        ("rotated", "rotated"),
        ("predicted_change", "predicted change"),
        ("gguf_sha256", "GGUF sha256 (first 16)"),
        ("gguf_identical", "GGUF identical"),
        ("report_identical", "report.json identical (less timings)"),
    ]
    md = (
        "# GGUF artifacts, byte for byte, before and after\n\n"
        f"`python -m benchmarks.gguf_identical`: old {old_label}, new {new_label}; each runs "
        "`higgs quantize --format gguf` with its own code on the same tiny llama checkpoint "
        "(tests/fixtures.py build_gguf_llama).\n\n"
        + markdown_table(rows, cols)
        + f"\n\nAll identical: **{'yes' if same else 'no'}**.\n"
    )
    json_path, md_path = write_results("gguf_identical", payload, md)
    print(md)
    print(f"wrote {json_path} and {md_path}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
