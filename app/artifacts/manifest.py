"""Checksummed file manifests of an artifact directory (pure Python, used by the worker)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app.jobs.rows import ArtifactRow, FileRow

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest_sha256(files: Iterable[tuple[str, str]]) -> str:
    """One digest for a whole artifact: sha256 over "<sha256>  <path>\\n" lines sorted by path
    (the format of `sha256sum`, so `sha256sum -c` can check a download)."""
    h = hashlib.sha256()
    for path, sha in sorted(files):
        h.update(f"{sha}  {path}\n".encode())
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    """The regular files under an artifact directory, sorted; a symlink is refused."""
    if not root.is_dir():
        raise FileNotFoundError(f"artifact directory {root} does not exist")
    paths: list[Path] = []
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            raise ValueError(f"artifact {root} contains a symlink {p}; refusing to publish it")
        if p.is_file():
            paths.append(p)
    return paths


def artifact_rows(dirs: Mapping[str, Path]) -> list[ArtifactRow]:
    """The artifact rows app.jobs.state.succeed() takes, one per {format: directory}.

    Every file of every format is hashed in one thread pool (hashlib releases the GIL on large
    buffers, so the formats and the shards of a model hash side by side)."""
    roots = {fmt: root.resolve() for fmt, root in dirs.items()}
    listed = {fmt: _files(root) for fmt, root in roots.items()}
    paths = [p for ps in listed.values() for p in ps]
    with ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1, 8))) as pool:
        digest = dict(zip(paths, pool.map(sha256_file, paths), strict=True))
    rows = []
    for fmt, root in roots.items():
        files = tuple(
            FileRow(p.relative_to(root).as_posix(), p.stat().st_size, digest[p])
            for p in listed[fmt]
        )
        rows.append(
            ArtifactRow(
                format=fmt,
                uri=root.as_uri(),
                files=files,
                total_bytes=sum(f.bytes for f in files),
                sha256=manifest_sha256((f.path, f.sha256) for f in files),
            )
        )
    return rows


def artifact_row(format: str, root: Path) -> ArtifactRow:
    """The artifact row of one format directory (see artifact_rows)."""
    return artifact_rows({format: root})[0]
