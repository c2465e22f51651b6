"""The rows a finished attempt hands to app.jobs.state.succeed: one per layer of the report and
one per artifact format, typed, so the worker and the state rules agree on their fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class InvalidRowError(ValueError):
    """A layer or artifact row handed to succeed() is malformed (a bug in the caller)."""


@dataclass(frozen=True)
class LayerRow:
    """One quantized (or kept) layer, as the report lists it."""

    name: str
    shape: tuple[int, ...]
    p: int
    n: int
    bits: float
    rel_error: float | None = None
    alpha: float | None = None
    bytes: int = 0
    type: str | None = None  # llama.cpp tensor type of a GGUF job's tensor

    @classmethod
    def from_report(cls, idx: int, row: Mapping[str, Any]) -> LayerRow:
        """Row `idx` of a report's "layers" list; InvalidRowError naming it when malformed."""
        try:
            return cls(
                name=str(row["name"]),
                shape=tuple(int(x) for x in row["shape"]),
                p=int(row["p"]),
                n=int(row["n"]),
                bits=float(row["bits"]),
                rel_error=None if row.get("rel_error") is None else float(row["rel_error"]),
                alpha=None if row.get("alpha") is None else float(row["alpha"]),
                bytes=int(row.get("bytes", 0)),
                type=None if row.get("type") is None else str(row["type"])[:16],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRowError(f"layer row {idx} ({dict(row)!r}) is malformed: {e}") from e


@dataclass(frozen=True)
class FileRow:
    path: str  # relative to the artifact's root, "/"-separated
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ArtifactRow:
    """One published format directory (app.artifacts.manifest.artifact_rows makes them)."""

    format: str
    uri: str  # where the files are: file:///<absolute dir> or s3://<bucket>/<prefix>
    files: tuple[FileRow, ...]
    total_bytes: int
    sha256: str  # manifest digest over the files (app.artifacts.manifest.manifest_sha256)
