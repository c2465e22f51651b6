"""Progress reporting: one callback type shared by the pipeline, the CLI and the service."""

from __future__ import annotations

from collections.abc import Callable

from higgs_engine.errors import CancelledError
from higgs_engine.planning.stages import STAGE_UNITS, STAGES

__all__ = ["STAGES", "STAGE_UNITS", "ProgressCallback", "report"]

# progress(stage, done, total) -> None | bool. Returning False (or raising CancelledError)
# cancels the work at the next layer boundary.
ProgressCallback = Callable[[str, int, int], "bool | None"]

# The stages and the unit each counts: higgs_engine.planning.stages (torch-free, the API's too).


def report(progress: ProgressCallback | None, stage: str, done: int, total: int) -> None:
    """Call the callback if any; turn a False return into CancelledError."""
    if progress is None:
        return
    if progress(stage, done, total) is False:
        raise CancelledError(f"cancelled by the caller during stage {stage!r} at {done}/{total}")
