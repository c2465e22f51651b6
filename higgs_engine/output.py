"""Atomic output directories: a run writes into a temporary sibling of its output directory,
which is renamed into place only when the run succeeded; on any error or cancellation the
temporary directory (and any parent directory the run created) is removed and the output
path is left as it was."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from higgs_engine.errors import HiggsError

__all__ = ["OutputExistsError", "atomic_output", "scratch_dir"]


class OutputExistsError(HiggsError, FileExistsError):
    """The output directory already exists and overwriting was not asked for."""

    code = "output_exists"


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.is_file() or out_dir.is_symlink():
        raise OutputExistsError(f"output path {str(out_dir)!r} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(
            f"output directory {str(out_dir)!r} already exists and is not empty; "
            "choose a new one or ask to overwrite it"
        )


def publish(tmp: Path, out_dir: Path) -> None:
    """Move the finished tmp dir to out_dir, replacing an existing one only at the last step."""
    trash = None
    if out_dir.exists():
        trash = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        out_dir.rename(trash)
    try:
        tmp.rename(out_dir)
    except BaseException:
        if trash is not None:
            trash.rename(out_dir)
        raise
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def mkdir_parents(path: Path) -> list[Path]:
    """Create missing parents of `path`; return those created (to remove on failure)."""
    created = []
    for parent in reversed(path.parents):
        if not parent.exists():
            parent.mkdir()
            created.append(parent)
    return created


@contextlib.contextmanager
def atomic_output(out_dir: Path, overwrite: bool = False) -> Iterator[Path]:
    """The temporary directory path (not yet created) to write `out_dir` into. An existing
    non-empty `out_dir` is refused (OutputExistsError) unless `overwrite`, and then replaced only
    once the new one is complete."""
    out_dir = Path(out_dir).expanduser().absolute()
    check_out_dir(out_dir, overwrite)
    created = mkdir_parents(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


@contextlib.contextmanager
def scratch_dir(beside: Path) -> Iterator[Path]:
    """A scratch directory next to `beside` (same file system), removed whatever happens."""
    beside = Path(beside).expanduser().absolute()
    d = beside.with_name(f".{beside.name}.scratch-{uuid.uuid4().hex[:8]}")
    d.mkdir(parents=True)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
