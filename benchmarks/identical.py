"""Artifacts of two revisions side by side, byte for byte: the same `higgs quantize` commands
run by each revision's own code on the same tiny checkpoints, every file's sha256 compared.

A revision is unpacked with `git archive REV | tar -x` into a temporary folder (as
benchmarks/house.py does; nothing is checked out); `worktree` is the working tree as it is.
Each command runs in a fresh interpreter with that tree first on PYTHONPATH (the installed
environment is shared), on the CPU with one thread. Compared: every file of `native/` and
`dequantized/`, and report.json without what a run measures (its timings, any "seconds",
the engine's wall time) and without paths (the output directory differs).

Configurations: uniform 4 and 3 bits; a dynamic average-bits target (its profile measured by
each revision into its own cache); calibrated HIGGS on a text; scope all; a sharded source
(quantized part by part and assembled); a dynamic target on the sharded source. The
checkpoints are random tiny Llamas built here (seeded: the same bytes every time).

Default: `bd571b3` (before the model was resolved once and a job planned as data) against the
working tree. Writes benchmarks/results/identical.json and .md.

    python -m benchmarks.identical [--old REV] [--new REV|worktree]
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
from benchmarks.house import ROOT, WORKTREE, unpack

TEXT = (
    "The committee met on Tuesday to discuss the new budget for the city library. "
    "Several members argued that the reading rooms needed longer opening hours, "
    "while others wanted to spend the money on digital services and new computers. "
) * 40

# name -> (checkpoint, arguments after SOURCE --out DIR)
PROFILE = ["--profile-random-tokens", "--profile-tokens", "64", "--profile-context", "32"]
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "uniform 4 bits": ("llama", ["--bits", "4"]),
    "uniform 3 bits": ("llama", ["--bits", "3"]),
    "dynamic avg-bits 3.5": ("llama", ["--avg-bits", "3.5", *PROFILE]),
    "calibrated 4 bits": (
        "llama",
        ["--bits", "4", "--calibration", "TEXT", "--calibration-tokens", "1024"],
    ),
    "scope all 4 bits": ("llama", ["--bits", "4", "--scope", "all"]),
    "sharded source, parts": ("sharded", ["--bits", "4"]),
    "sharded source, dynamic": ("sharded", ["--avg-bits", "3.5", *PROFILE]),
}
MEASURED = {"timings", "seconds", "engine_wall_s"}


def build_checkpoints(root: Path) -> dict[str, Path]:
    """A random tiny Llama (seeded) with a byte-level BPE tokenizer, saved whole and in shards."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a few wide rows, as real checkpoints have outliers
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(0.05 * torch.randn(p.shape, generator=g) ** 3)
    out = {}
    for name, shard in (("llama", None), ("sharded", "60KB")):
        dest = root / name
        kw: dict[str, Any] = {"safe_serialization": True}
        if shard is not None:
            kw["max_shard_size"] = shard
        model.save_pretrained(str(dest), **kw)
        fast.save_pretrained(str(dest))
        out[name] = dest
    return out


def normalised_report(path: Path, out: Path) -> dict[str, Any]:
    """report.json without what a run measures and with the output directory as `OUT`."""

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if k not in MEASURED}
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, str):
            return v.replace(str(out), "OUT")
        return v

    return dict(clean(json.loads(path.read_text())))


def digests(out: Path) -> dict[str, str]:
    found = {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for fmt in ("native", "dequantized")
        for p in sorted((out / fmt).rglob("*"))
        if p.is_file()
    }
    report = json.dumps(normalised_report(out / "report.json", out), sort_keys=True)
    found["report.json (normalised)"] = hashlib.sha256(report.encode()).hexdigest()
    return found


def quantize_command(
    tree: Path, ckpt: Path, out: Path, args: list[str], work: Path, code: str = ""
) -> tuple[list[str], dict[str, str]]:
    """`higgs quantize` by `tree`'s code in a fresh interpreter (`code`: run before the CLI in
    it): the command and its environment."""
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "XDG_CACHE_HOME": str(out.parent / "cache"),
    }
    cmd = [
        sys.executable,
        "-c",
        code + "\nimport sys; from higgs_cli.main import main; sys.exit(main(sys.argv[1:]))",
        "quantize",
        str(ckpt),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--quiet",
        "--profile-cache",
        str(out.parent / "profiles"),
        *[str(work / "text.txt") if a == "TEXT" else a for a in args],
    ]
    return cmd, env


def quantize(tree: Path, ckpt: Path, out: Path, args: list[str], work: Path) -> None:
    """`higgs quantize` run by `tree`'s code in a fresh interpreter."""
    cmd, env = quantize_command(tree, ckpt, out, args, work)
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(cmd[3:])} failed:\n{done.stderr[-2000:]}")


def tree_of(rev: str, tmp: Path) -> tuple[Path, str]:
    if rev == WORKTREE:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        return ROOT, f"working tree (HEAD {head[:9]})"
    dest = tmp / rev.replace("/", "_").replace("~", "_")
    commit = unpack(rev, dest)
    return dest, f"{rev} ({commit[:9]})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="bd571b3")
    ap.add_argument("--new", default=WORKTREE)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="higgs-identical-") as t:
        tmp = Path(t)
        ckpts = build_checkpoints(tmp / "ckpt")
        (tmp / "text.txt").write_text(TEXT)
        trees = {"old": tree_of(args.old, tmp / "trees"), "new": tree_of(args.new, tmp / "trees")}
        rows: list[dict[str, Any]] = []
        for i, (name, (ckpt, cli)) in enumerate(CONFIGS.items()):
            got = {}
            for side, (tree, _) in trees.items():
                out = tmp / side / f"c{i}" / "out"
                out.parent.mkdir(parents=True)
                quantize(tree, ckpts[ckpt], out, cli, tmp)
                got[side] = digests(out)
            differ = sorted(
                f
                for f in set(got["old"]) | set(got["new"])
                if got["old"].get(f) != got["new"].get(f)
            )
            rows.append(
                {
                    "configuration": name,
                    "command": f"higgs quantize {ckpt} " + " ".join(cli),
                    "files": len(got["new"]),
                    "identical": not differ,
                    "differing": differ,
                    "old": got["old"],
                    "new": got["new"],
                }
            )
            print(f"{name}: {'identical' if not differ else 'DIFFERENT: ' + ', '.join(differ)}")
    payload = {
        "benchmark": "identical",
        "old": trees["old"][1],
        "new": trees["new"][1],
        "compared": "every file of native/ and dequantized/ (sha256), and report.json without "
        "timings, 'seconds' and engine wall time, paths as OUT (sha256 of its canonical JSON)",
        "configurations": rows,
        "all_identical": all(r["identical"] for r in rows),
    }
    table = markdown_table(
        [
            {
                "configuration": r["configuration"],
                "command": f"`{r['command']}`",
                "files": r["files"],
                "identical": "yes" if r["identical"] else "NO: " + ", ".join(list(r["differing"])),
            }
            for r in rows
        ],
        [("configuration", ""), ("command", "command"), ("files", "files"), ("identical", "")],
    )
    md = (
        f"# Artifacts before and after, byte for byte\n\n"
        f"`python -m benchmarks.identical`: {payload['old']} against {payload['new']}, the same "
        f"commands on the same seeded tiny checkpoints, on the CPU with one thread. Compared: "
        f"{payload['compared']}.\n\n{table}\n"
    )
    json_path, md_path = write_results("identical", payload, md)
    print(f"wrote {json_path} and {md_path}")
    if not payload["all_identical"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
