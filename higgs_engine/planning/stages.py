"""The stages a run reports progress in (`progress(stage, done, total)`) and what each stage
counts, its unit: named once, torch-free, so that the CLI's bars, the API's `progress.unit`
and the web console all read the same table.

Every emitter counts its stage's unit: the engine (higgs_engine: pipeline, parts, calibration,
selfgen, profile, evaluate, gguf/, planning.plans) and the worker (runner, fanout, publish).
A stage done in one go reports 0 then 1 of 1 "step".
"""

from __future__ import annotations

__all__ = ["STAGES", "STAGE_UNITS", "stage_unit"]

STAGE_UNITS: dict[str, str] = {
    "resolving": "step",
    "loading": "step",
    "converting": "step",  # GGUF: llama.cpp's converter, the whole checkpoint at once
    "generating": "token",  # the data-free profile text the model writes, token by token
    "profiling": "window",  # the profile's text windows (the Fisher passes over each)
    "probing": "layer",  # a noise-injection profile, one layer at a time
    "measuring": "tensor",  # GGUF: each tensor's error in each llama.cpp type
    "allocating": "step",
    "calibrating": "layer",  # the block-by-block calibration pass
    "quantizing": "layer",  # HIGGS layers; GGUF: the tensors llama.cpp's quantizer writes
    "evaluating": "window",  # perplexity / KL windows of the evaluation text
    "packaging": "step",
    "uploading": "file",  # the worker storing the artifact's files
}
STAGES: tuple[str, ...] = tuple(STAGE_UNITS)
DEFAULT_UNIT = "step"


def stage_unit(stage: str | None) -> str | None:
    """What `stage`'s progress counts ("step" for a stage not in the table); None without a
    stage."""
    if stage is None:
        return None
    return STAGE_UNITS.get(stage, DEFAULT_UNIT)
