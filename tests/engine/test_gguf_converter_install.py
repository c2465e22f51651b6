"""llama.cpp's converter laid out from llama-cpp-python's source archive: only the converter's
files, never a path outside the destination, replaced whole; and the engine's fallback to the
user's cache when no converter is installed."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from higgs_engine.gguf import convert, converter_install
from higgs_engine.gguf.converter_install import (
    ConverterInstallError,
    install_from_sdist,
    installed_version,
)
from higgs_engine.gguf.llama import LlamaUnavailableError

V = "9.9.9"
ROOT = f"llama_cpp_python-{V}/vendor/llama.cpp/"


def _sdist(path: Path, extra: dict[str, bytes] | None = None, *, converter: bool = True) -> Path:
    files = {
        ROOT + "conversion/__init__.py": b"",
        ROOT + "conversion/base.py": b"# base\n",
        ROOT + "gguf-py/gguf/__init__.py": b"",
        ROOT + "LICENSE": b"MIT\n",
        ROOT + "src/llama.cpp": b"// not needed\n",
        f"llama_cpp_python-{V}/llama_cpp/__init__.py": b"",
        **(extra or {}),
    }
    if converter:
        files[ROOT + "convert_hf_to_gguf.py"] = b"print('converter')\n"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo(ROOT + "conversion/link.py")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
    return path


def _tree(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() or p.is_symlink()}


def test_only_the_converter_files_are_copied(tmp_path: Path) -> None:
    sdist = _sdist(
        tmp_path / "s.tar.gz",
        {
            ROOT + "conversion/../../../../escape.py": b"x",
            "/abs/conversion/evil.py": b"x",
        },
    )
    dest = install_from_sdist(sdist, tmp_path / "conv", V)
    assert _tree(dest) == {
        "convert_hf_to_gguf.py",
        "LICENSE",
        "VERSION",
        "conversion/__init__.py",
        "conversion/base.py",
        "gguf-py/gguf/__init__.py",
    }
    assert installed_version(dest) == V
    assert not (tmp_path / "escape.py").exists()
    # nothing staged is left beside the destination
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv", "s.tar.gz"]


def test_a_new_layout_replaces_the_old_one_whole(tmp_path: Path) -> None:
    dest = tmp_path / "conv"
    dest.mkdir()
    (dest / "stale.py").write_text("old")
    install_from_sdist(_sdist(tmp_path / "s.tar.gz"), dest, V)
    assert not (dest / "stale.py").exists()
    assert (dest / "convert_hf_to_gguf.py").read_text() == "print('converter')\n"


def test_an_archive_without_the_converter_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    sdist = _sdist(tmp_path / "s.tar.gz", converter=False)
    with pytest.raises(ConverterInstallError, match=r"convert_hf_to_gguf\.py"):
        install_from_sdist(sdist, tmp_path / "conv", V)
    with pytest.raises(ConverterInstallError, match=r"no llama_cpp_python-1\.0\.0"):
        install_from_sdist(_sdist(tmp_path / "t.tar.gz"), tmp_path / "conv", "1.0.0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.tar.gz", "t.tar.gz"]


def test_a_broken_archive_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not an archive")
    with pytest.raises(ConverterInstallError, match=r"bad\.tar\.gz"):
        install_from_sdist(bad, tmp_path / "conv", V)


def test_the_file_runs_by_its_path_with_the_standard_library_only(tmp_path: Path) -> None:
    # scripts/setup runs it before the project is installed: no package import may be needed
    sdist = _sdist(tmp_path / "s.tar.gz")
    script = Path(converter_install.__file__)
    res = subprocess.run(
        [sys.executable, "-S", "-I", str(script), "--version", V, "--sdist", str(sdist),
         "--dest", str(tmp_path / "conv")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert installed_version(tmp_path / "conv") == V
    res = subprocess.run(
        [sys.executable, "-S", "-I", str(script), "--version", "1.0.0", "--sdist", str(sdist),
         "--dest", str(tmp_path / "other")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 1
    assert res.stderr.startswith("setup: ") and len(res.stderr.strip().splitlines()) == 1


def test_pip_failing_to_download_is_one_error_naming_the_version(tmp_path: Path) -> None:
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path), "PIP_CONFIG_FILE": os.devnull}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with pytest.raises(ConverterInstallError, match=r"llama-cpp-python 0\.0\.1"):
            converter_install.fetch_converter("0.0.1", tmp_path / "conv")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert not (tmp_path / "conv").exists()


def test_without_an_installed_converter_the_engine_fills_the_users_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(convert, "default_converter_dir", lambda: tmp_path / "none")
    monkeypatch.setattr(convert, "llama_cpp_python_version", lambda: V)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sdist = _sdist(tmp_path / "s.tar.gz")
    fetched: list[str] = []

    def fetch(version: str, dest: Path) -> Path:
        fetched.append(version)
        return install_from_sdist(sdist, dest, version)

    monkeypatch.setattr(converter_install, "fetch_converter", fetch)
    want = tmp_path / "cache" / "higgs-service" / "llama-cpp-converter" / V
    assert convert.converter_dir() == want
    assert convert.converter_dir() == want  # once per version
    assert fetched == [V]
    assert (want / "convert_hf_to_gguf.py").is_file()


def test_a_failed_fetch_is_llama_unavailable_naming_both_places(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(convert, "default_converter_dir", lambda: tmp_path / "none")
    monkeypatch.setattr(convert, "llama_cpp_python_version", lambda: V)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def fetch(version: str, dest: Path) -> Path:
        raise ConverterInstallError("pip could not download it")

    monkeypatch.setattr(converter_install, "fetch_converter", fetch)
    with pytest.raises(LlamaUnavailableError, match=r"none.*pip could not download it"):
        convert.converter_dir()


def test_an_explicit_directory_without_the_converter_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LlamaUnavailableError, match=re.escape(str(tmp_path))):
        convert.converter_dir(tmp_path)
