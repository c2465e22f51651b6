"""Progress reporting: one callback type shared by the pipeline, the CLI and the service."""

from __future__ import annotations

from collections.abc import Callable

from higgs_engine.errors import CancelledError

# progress(stage, done, total) -> None | bool. Returning False (or raising CancelledError)
# cancels the work at the next layer boundary.
ProgressCallback = Callable[[str, int, int], "bool | None"]

STAGES = (
    "resolving",
    "loading",
    "generating",
    "profiling",
    "allocating",
    "calibrating",
    "quantizing",
    "evaluating",
    "packaging",
)


def report(progress: ProgressCallback | None, stage: str, done: int, total: int) -> None:
    """Call the callback if any; turn a False return into CancelledError."""
    if progress is None:
        return
    if progress(stage, done, total) is False:
        raise CancelledError(f"cancelled by the caller during stage {stage!r} at {done}/{total}")
