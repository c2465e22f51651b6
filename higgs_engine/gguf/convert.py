"""llama.cpp's own converter: a Hugging Face checkpoint -> a 16-bit GGUF file with the model's
architecture metadata, tokenizer and chat template, exactly as llama.cpp expects them.

The converter (convert_hf_to_gguf.py with its conversion/ package and the gguf-py library of the
same llama.cpp commit) is not in llama-cpp-python's wheel: scripts/setup copies it from the
llama-cpp-python source distribution into `<venv>/share/higgs-service/llama.cpp/`, and the
worker image does the same. Where neither did (`pip install ".[gguf]"`), the first GGUF job
downloads the installed version's source distribution with pip and lays the converter out in
the user's cache (higgs_engine.gguf.converter_install), once per version. It runs as a
subprocess of the current interpreter.
"""

from __future__ import annotations

import ast
import functools
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from higgs_engine.errors import HiggsError, OutOfMemoryError, UnsupportedModelError
from higgs_engine.gguf import converter_install
from higgs_engine.gguf.llama import LlamaError, LlamaUnavailableError

log = logging.getLogger(__name__)

CONVERTER_SCRIPT = converter_install.CONVERTER_SCRIPT


def default_converter_dir() -> Path:
    """Where scripts/setup and the worker image put llama.cpp's converter."""
    return Path(sys.prefix) / "share" / "higgs-service" / "llama.cpp"


def cached_converter_dir(version: str) -> Path:
    """Where the engine lays out the converter of llama-cpp-python `version` itself:
    `${XDG_CACHE_HOME:-~/.cache}/higgs-service/llama-cpp-converter/<version>`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "higgs-service" / "llama-cpp-converter" / version


def llama_cpp_python_version() -> str:
    """The installed llama-cpp-python's version, or LlamaUnavailableError."""
    from importlib import metadata

    try:
        return metadata.version(converter_install.DISTRIBUTION)
    except metadata.PackageNotFoundError as e:
        raise LlamaUnavailableError(
            'the GGUF format needs llama.cpp: pip install ".[gguf]" (llama-cpp-python)'
        ) from e


_FETCH_LOCK = threading.Lock()


def converter_dir(path: Path | None = None) -> Path:
    """The converter's directory (holding convert_hf_to_gguf.py, conversion/, gguf-py/).

    `path` when given; else the one scripts/setup or the worker image installed; else the
    user's cache for the installed llama-cpp-python version, filled on first use (a download
    of that version's source distribution with pip)."""
    if path is not None:
        d = Path(path)
        if not (d / CONVERTER_SCRIPT).is_file():
            raise LlamaUnavailableError(f"llama.cpp's converter is not installed at {d}")
        return d
    d = default_converter_dir()
    if (d / CONVERTER_SCRIPT).is_file():
        return d
    version = llama_cpp_python_version()
    cached = cached_converter_dir(version)
    with _FETCH_LOCK:
        if converter_install.installed_version(cached) != version:
            log.info(
                "laying out llama.cpp's converter (llama-cpp-python %s) in %s", version, cached
            )
            try:
                converter_install.fetch_converter(version, cached)
            except converter_install.ConverterInstallError as e:
                raise LlamaUnavailableError(
                    f"llama.cpp's converter is not installed ({d} has none) and {e}"
                ) from e
    return cached


@functools.lru_cache(maxsize=8)
def _architectures(d: Path) -> frozenset[str]:
    names: set[str] = set()
    files = [d / CONVERTER_SCRIPT, *sorted((d / "conversion").glob("*.py"))]
    for f in files:
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            if isinstance(fn, ast.Attribute) and fn.attr == "register":
                names.update(
                    a.value
                    for a in node.args
                    if isinstance(a, ast.Constant) and isinstance(a.value, str)
                )
    return frozenset(names)


def supported_architectures(path: Path | None = None) -> frozenset[str]:
    """The Hugging Face `architectures` names the installed converter registers (read from its
    source, not imported)."""
    return _architectures(converter_dir(path))


def check_architecture(architectures: list[str] | None, path: Path | None = None) -> str:
    """The first of a checkpoint's `architectures` the converter knows, or UnsupportedModelError
    naming them."""
    known = supported_architectures(path)
    for a in architectures or []:
        if a in known:
            return a
    raise UnsupportedModelError(
        f"llama.cpp's converter does not know the architecture {architectures or '(none)'}; "
        "choose the native or dequantized format for this model"
    )


def convert_checkpoint(
    checkpoint: Path,
    out_file: Path,
    *,
    outtype: str = "auto",
    converter: Path | None = None,
    split_max_bytes: int | None = None,
    timeout_s: float | None = None,
) -> Path:
    """Run llama.cpp's converter on a local checkpoint directory; returns `out_file`.

    outtype: "auto" (the checkpoint's own 16-bit type: bf16 stays bf16, float32 becomes f16),
    "f16", "bf16" or "f32". With `split_max_bytes`, shards of at most that size named
    <out_file stem>-0000k-of-0000N.gguf (llama.cpp's split files); `out_file` is then the first.
    A failure raises LlamaError with the converter's last lines (OutOfMemoryError when it ran
    out of memory). The checkpoint's tensors are checked to be finite first (check_finite):
    llama.cpp aborts its process on a NaN scale instead of raising."""
    from higgs_engine.checkpoint_check import check_finite

    d = converter_dir(converter)
    check_finite(Path(checkpoint))
    cmd = [
        sys.executable,
        str(d / CONVERTER_SCRIPT),
        str(checkpoint),
        "--outfile",
        str(out_file),
        "--outtype",
        outtype,
    ]
    if split_max_bytes is not None:
        cmd += ["--split-max-size", str(int(split_max_bytes))]
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter must use the gguf-py of its own commit
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        res = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise LlamaError(f"llama.cpp's converter ran past {timeout_s} s on {checkpoint}") from e
    written = (
        sorted(out_file.parent.glob(f"{out_file.stem}-*-of-*.gguf"))
        if split_max_bytes is not None
        else [out_file]
    )
    if res.returncode != 0 or not written or not written[0].is_file():
        raise _converter_error(checkpoint, res.stderr or res.stdout or "", res.returncode)
    return written[0]


# What a process that could not get memory prints: Python, C++ (llama.cpp), the C library.
_OUT_OF_MEMORY = (
    "MemoryError",
    "std::bad_alloc",
    "Cannot allocate memory",
    "can't allocate memory",
)


def _converter_error(checkpoint: Path, output: str, returncode: int = 1) -> HiggsError:
    """The converter's own exception line as one message: what it does not support in the
    checkpoint (NotImplementedError: a tokenizer or layer it does not know) is
    UnsupportedModelError, running out of memory (under the caller's memory limit, or killed
    by a signal) OutOfMemoryError, anything else LlamaError."""
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    if any(m in output for m in _OUT_OF_MEMORY) or returncode == -9:
        return OutOfMemoryError(
            f"llama.cpp's converter ran out of memory on {checkpoint.name}"
            + (" (killed by SIGKILL)" if returncode == -9 else "")
        )
    found = next(
        (
            m
            for ln in reversed(lines)
            if (m := re.match(r"^([A-Za-z_.]*(?:Error|Exception)): (.+)$", ln))
        ),
        None,
    )
    if found is None:
        return LlamaError(
            f"llama.cpp's converter failed on {checkpoint.name}: {lines[-1] if lines else 'no output'}"
        )
    kind, msg = found.group(1), found.group(2)
    if kind == "NotImplementedError":
        return UnsupportedModelError(
            f"llama.cpp's converter does not support {checkpoint.name}: {msg}"
        )
    return LlamaError(f"llama.cpp's converter failed on {checkpoint.name}: {kind}: {msg}")
