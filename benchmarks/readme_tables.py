"""Copy the latest measured tables from benchmarks/results/*.md into README.md.

Replaces everything from the "## Benchmarks (latest measured tables)" heading to the end of the
README; measures nothing. Run after a benchmark: `python benchmarks/readme_tables.py`.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "\n## Benchmarks (latest measured tables)\n"
SECTIONS = [  # (results file stem, script that writes it)
    ("quality_smollm2", "quality.py --model smollm2"),
    ("rtn_crosscheck", "rtn_crosscheck.py"),
    ("quality_minilm", "quality.py --model minilm"),
    ("speed", "speed.py"),
    ("speed_default_threads", "speed.py --threads 0 (HIGGS p=2 n=256 vs RTN-4 only)"),
    ("memory", "memory.py"),
    ("dynamic", "dynamic.py"),
    ("allocator_speed", "allocator_speed.py"),
    ("service", "service_bench.py"),
]
INTRO = """
Every table below was written by the named script in one run on this project's 2-core CPU
machine (no GPU was lent to this task) and is copied from `benchmarks/results/` (JSON beside
each) by `benchmarks/readme_tables.py`. The machine was shared with other work during some runs
(each table gives its load average), so wall times are noisy; speed ratios come from interleaved
runs in one process. Rerun with `.venv/bin/python benchmarks/<script>`.
"""


def demote(line: str) -> str:
    """'# T' -> '### T', '## T' -> '#### T', '### T' stays: tables nest under this section."""
    if line.startswith("### "):
        return line
    if line.startswith("## "):
        return "####" + line[2:]
    if line.startswith("# "):
        return "###" + line[1:]
    return line


def section(stem: str, script: str) -> str:
    md = (RESULTS / f"{stem}.md").read_text().strip().splitlines()
    lines = [demote(ln) for ln in md]
    lines = [
        ln.replace("](", "](benchmarks/results/", 1) if ln.startswith("![") else ln for ln in lines
    ]
    return (
        f"<!-- from benchmarks/results/{stem}.md, written by benchmarks/{script} -->\n\n"
        + "\n".join(lines)
    )


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    if MARKER in text:
        text = text[: text.index(MARKER)]
    body = [section(stem, script) for stem, script in SECTIONS if (RESULTS / f"{stem}.md").exists()]
    readme.write_text(text.rstrip() + "\n" + MARKER + INTRO + "\n" + "\n\n".join(body) + "\n")


if __name__ == "__main__":
    main()
