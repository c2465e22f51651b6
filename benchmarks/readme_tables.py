"""Write benchmarks/README.md from the latest measured tables in benchmarks/results/*.md.

Measures nothing: it copies each results file (written by the named script in one run) under a
heading. Run after a benchmark: `python -m benchmarks.readme_tables`.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SECTIONS = [  # (results file stem, script that writes it)
    ("quality_smollm2", "python -m benchmarks.quality --model smollm2"),
    ("rtn_crosscheck", "python -m benchmarks.rtn_crosscheck"),
    ("quality_minilm", "python -m benchmarks.quality --model minilm"),
    ("ct_native", "python -m benchmarks.ct_native"),
    ("decode_speed", "python -m benchmarks.decode_speed"),
    ("llmcompressor", "python -m benchmarks.llmcompressor"),
    ("ct_rotation", "python -m benchmarks.ct_rotation"),
    ("gguf_smollm2", "python -m benchmarks.gguf --model smollm2 --threads 1"),
    ("gguf_minilm", "python -m benchmarks.gguf --model minilm --threads 1"),
    (
        "gguf_rotation_smollm2",
        "python -m benchmarks.gguf --model smollm2 --threads 1 --rotation-only",
    ),
    (
        "ablation_smollm2",
        "python -m benchmarks.ablation --model smollm2 (three processes, joined with --merge)",
    ),
    ("ablation_minilm", "python -m benchmarks.ablation --model minilm"),
    ("error_structure", "python -m benchmarks.error_structure"),
    (
        "speed_quiet",
        "python -m benchmarks.speed --threads 2 1 --repeats 5 --methods (the key methods) "
        "--no-pipeline --no-gpu-path --skip-hqq --name speed_quiet (a quiet machine)",
    ),
    (
        "speed_defaults",
        "python -m benchmarks.speed --threads 2 1 --name speed_defaults (the key methods only)",
    ),
    ("speed_defaults_2", "the same, a second run (files renamed from speed_defaults)"),
    ("scale_search", "python -m benchmarks.scale_search"),
    ("scale_search_minilm_seed1", "python -m benchmarks.scale_search --model minilm --sign-seed 1"),
    ("scale_search_minilm_seed2", "python -m benchmarks.scale_search --model minilm --sign-seed 2"),
    ("speed", "python -m benchmarks.speed"),
    (
        "speed_default_threads",
        "python -m benchmarks.speed --threads 0 (HIGGS p=2 n=256 vs RTN-4 only)",
    ),
    ("memory", "python -m benchmarks.memory"),
    ("calibrated_cost", "python -m benchmarks.calibrated_cost"),
    ("calibrated_profile", "python -m benchmarks.calibrated_profile"),
    ("dynamic", "python -m benchmarks.dynamic"),
    ("scope_smollm2", "python -m benchmarks.scope --model smollm2 --threads 1"),
    ("scope_minilm", "python -m benchmarks.scope --model minilm --threads 1"),
    ("datafree_sources", "python -m benchmarks.datafree_sources (SmolLM2)"),
    ("datafree_sources_minilm", "python -m benchmarks.datafree_sources --model minilm"),
    (
        "profile_cost",
        "python -m benchmarks.profile_cost --count 16 --length 96 --repeats 3 (a busy machine)",
    ),
    (
        "profile_cost_quiet",
        "python -m benchmarks.profile_cost --count 16 --length 96 --repeats 3 "
        "--name profile_cost_quiet",
    ),
    ("omp_wait", "python -m benchmarks.omp_wait --repeats 1"),
    ("full_run", "python -m benchmarks.full_run --model smollm2 (a quiet machine)"),
    (
        "full_run_busy",
        "python -m benchmarks.full_run --model all, on a busy machine "
        "(files renamed from full_run)",
    ),
    ("allocator_speed", "python -m benchmarks.allocator_speed"),
    (
        "service_api_quiet",
        "python -m benchmarks.service_bench --api-only --no-sqlite --stem service_api_quiet",
    ),
    ("service_api", "python -m benchmarks.service_bench --api-only"),
    ("service", "python -m benchmarks.service_bench"),
    ("service_noisy", "python -m benchmarks.service_bench --noisy"),
    ("fanout", "python -m benchmarks.fanout"),
    ("house", "python -m benchmarks.house"),
    ("resolutions", "python -m benchmarks.resolutions"),
    ("gguf_identical", "python -m benchmarks.gguf_identical"),
    ("identical", "python -m benchmarks.identical"),
]
OUT = ROOT / "benchmarks" / "README.md"
HEADER = """# Benchmarks (latest measured tables)

Every table below was written by the named script in one run on a shared 2-core CPU machine
without a GPU, and is copied from `results/` (JSON beside each) by `readme_tables.py`; nothing
here is typed in by hand. Other work ran on the machine during some runs (each table gives its
load average), so wall times are noisy; speed ratios come from interleaved runs in one process.
Rerun a benchmark with `.venv/bin/python -m benchmarks.<script>`, then
`.venv/bin/python -m benchmarks.readme_tables`. `scripts/gpu_check` runs `gpu_speed.py` (CPU
versus CUDA timings) on a machine with CUDA; it has no table here until it has run on one.
What the tables say, target by target, misses included: [docs/benchmarks.md](../docs/benchmarks.md).
"""


def heading_level(line: str) -> int:
    """Number of leading '#' of a markdown heading line ('# T' -> 1), 0 for other lines."""
    hashes = len(line) - len(line.lstrip("#"))
    return hashes if hashes and line[hashes : hashes + 1] == " " else 0


def nest(lines: list[str]) -> list[str]:
    """Shift every heading so that the file's top level becomes '##' (under the page title)."""
    levels = [heading_level(ln) for ln in lines if heading_level(ln)]
    if not levels:
        return lines
    shift = 2 - min(levels)
    return [
        "#" * (heading_level(ln) + shift) + ln[heading_level(ln) :] if heading_level(ln) else ln
        for ln in lines
    ]


def section(stem: str, script: str) -> str:
    md = (RESULTS / f"{stem}.md").read_text().strip().splitlines()
    lines = nest(md)
    lines = [ln.replace("](", "](results/", 1) if ln.startswith("![") else ln for ln in lines]
    return f"<!-- from results/{stem}.md, written by {script} -->\n\n" + "\n".join(lines)


def render() -> str:
    body = [section(stem, script) for stem, script in SECTIONS if (RESULTS / f"{stem}.md").exists()]
    return HEADER + "\n" + "\n\n".join(body) + "\n"


def main() -> None:
    OUT.write_text(render())


if __name__ == "__main__":
    main()
