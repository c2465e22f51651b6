"""llama.cpp's converter laid out from llama-cpp-python's source distribution.

The converter (convert_hf_to_gguf.py, its conversion/ package and the gguf-py library of the
same llama.cpp commit) ships in llama-cpp-python's source distribution, not in the wheel pip
installs, so `pip install ".[gguf]"` alone has the library but not the converter.
`install_from_sdist` copies those files out of the archive into a directory; `fetch_converter`
first downloads the source distribution of the installed llama-cpp-python's version from the
package index (pip's `download`, the index pip is configured with) into a temporary directory.
The engine does this once, into the user's cache, the first time a GGUF job finds no converter
(higgs_engine.gguf.convert.converter_dir); scripts/setup runs this file with `--sdist` on the
archive it has already downloaded.

Standard library only, and no imports from the package: scripts/setup runs this file by its
path before the project is installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

CONVERTER_SCRIPT = "convert_hf_to_gguf.py"
DISTRIBUTION = "llama-cpp-python"
# What the converter needs, relative to llama.cpp's root in the source distribution.
_FILES = (CONVERTER_SCRIPT, "LICENSE")
_FOLDERS = ("conversion", "gguf-py")
VERSION_FILE = "VERSION"


class ConverterInstallError(Exception):
    """The converter could not be laid out: the archive lacks it, or pip could not fetch it."""


def _relative(name: str, root: str) -> PurePosixPath | None:
    """The member's path below llama.cpp's root when it is one the converter needs, else None.
    Absolute names and `..` parts are never taken."""
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or not name.startswith(root):
        return None
    rel = PurePosixPath(name[len(root) :])
    if not rel.parts:
        return None
    if str(rel) in _FILES or rel.parts[0] in _FOLDERS:
        return rel
    return None


def install_from_sdist(sdist: Path, dest: Path, version: str) -> Path:
    """Copy the converter out of llama-cpp-python's source archive `sdist` (version `version`)
    into `dest`, replacing what is there; returns `dest`. Only regular files are written; the
    copy is staged beside `dest` and moved into place whole, so a reader never sees half of it.
    """
    root = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        written = 0
        try:
            with tarfile.open(sdist, "r:*") as tar:
                for member in tar:
                    rel = _relative(member.name, root)
                    if rel is None or not member.isfile():
                        continue
                    src = tar.extractfile(member)
                    if src is None:
                        continue
                    target = staged.joinpath(*rel.parts)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with src, open(target, "wb") as out:
                        shutil.copyfileobj(src, out)
                    written += 1
        except (OSError, tarfile.TarError) as e:
            raise ConverterInstallError(f"cannot read {sdist}: {e}") from e
        if not (staged / CONVERTER_SCRIPT).is_file() or not (staged / "gguf-py").is_dir():
            raise ConverterInstallError(
                f"{sdist} holds no {root}{CONVERTER_SCRIPT} with its gguf-py "
                f"({written} matching files): not llama-cpp-python {version}'s source"
            )
        (staged / VERSION_FILE).write_text(version + "\n", encoding="utf-8")
        old = dest.with_name(f".{dest.name}-old-{os.getpid()}")
        if dest.exists():
            dest.rename(old)
        try:
            staged.rename(dest)
        except OSError as e:
            # another process laid out the same version meanwhile: keep its copy
            if installed_version(dest) == version:
                shutil.rmtree(old, ignore_errors=True)
                return dest
            if old.exists() and not dest.exists():
                old.rename(dest)
            raise ConverterInstallError(f"cannot move the converter into {dest}: {e}") from e
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return dest


def installed_version(dest: Path) -> str | None:
    """The llama-cpp-python version whose converter `dest` holds, or None."""
    try:
        return (Path(dest) / VERSION_FILE).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def fetch_sdist(version: str, into: Path, *, timeout_s: float = 900.0) -> Path:
    """Download llama-cpp-python `version`'s source distribution with pip into `into`."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
        "--no-deps", "--no-binary", ":all:", f"{DISTRIBUTION}=={version}", "--dest", str(into),
    ]  # fmt: skip
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise ConverterInstallError(
            f"pip took over {timeout_s:.0f} s to download {DISTRIBUTION} {version}'s source"
        ) from e
    found = sorted(Path(into).glob(f"llama_cpp_python-{version}.tar.gz"))
    if res.returncode != 0 or not found:
        lines = [ln for ln in (res.stderr or res.stdout or "").splitlines() if ln.strip()]
        raise ConverterInstallError(
            f"pip could not download {DISTRIBUTION} {version}'s source distribution, which "
            f"holds llama.cpp's converter: {lines[-1].strip() if lines else 'no output'}"
        )
    return found[0]


def fetch_converter(version: str, dest: Path) -> Path:
    """Download llama-cpp-python `version`'s source and lay its converter out in `dest`."""
    with tempfile.TemporaryDirectory(prefix="higgs-llama-sdist-") as tmp:
        return install_from_sdist(fetch_sdist(version, Path(tmp)), dest, version)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="lay out llama.cpp's converter")
    ap.add_argument("--version", required=True, help="llama-cpp-python's version")
    ap.add_argument("--dest", required=True, type=Path)
    ap.add_argument("--sdist", type=Path, help="the source archive (default: download it)")
    a = ap.parse_args(argv)
    try:
        if a.sdist is not None:
            install_from_sdist(a.sdist, a.dest, a.version)
        else:
            fetch_converter(a.version, a.dest)
    except ConverterInstallError as e:
        print(f"setup: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
