"""The job config: what the API validated and the worker runs, stored on the job row (jobs.config).

Written once at submit by app.jobs.service.validate_request, read by the worker's runner, and
shown as-is by GET /v1/jobs/{id}. Stored as JSON; `JobConfig.load` reads every shape ever
stored, so a job queued before an upgrade still runs after it:

    version 1   {"version": 1, "engine": <HiggsConfig.to_dict()>,
                 "target": {"bits" | "avg_bits" | "max_ppl_increase": number},
                 "evaluate": bool,   ("evaluate" may be missing in early rows: false)
                 "calibration": {"id", "sha256", "bytes", "tokens"},  (calibrated jobs only)
                 "menu_p": int,  (dynamic jobs restricted to one grid dimension only)
                 "gguf": true,  (GGUF jobs only: llama.cpp's types; "engine" then unused)
                 "gguf_rotate": "on" | "auto",  (GGUF jobs asking for a rotation only)
                 "ct": true}  (compressed-tensors jobs only: vLLM's schemes; "engine"
                               carries only the checkpoint's dtype that is used)

A new shape gets a new version number and a branch in `load`; `to_dict` always writes the
newest one.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.plans.planner import DYNAMIC_TARGETS
from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.config import HiggsConfig

JOB_CONFIG_VERSION = 1
TARGET_KINDS = ("bits", *DYNAMIC_TARGETS)


class JobConfig(BaseModel):
    """A job's validated config. Immutable; `engine` is a complete HiggsConfig dict."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    engine: dict[str, Any]
    target: dict[str, float] = Field(
        description="exactly one of bits / avg_bits / max_ppl_increase"
    )
    evaluate: bool = False
    # Calibrated HIGGS: {"id", "sha256", "bytes", "tokens"} of an uploaded text
    # (POST /v1/calibrations); absent for data-free jobs.
    calibration: dict[str, Any] | None = None
    # Dynamic targets: the grid dimension the user restricted the allocator's menu to
    # (options.p); None = every dimension. Configs written before this field existed leave it
    # out and the worker reads options.p from the stored request instead.
    menu_p: int | None = None
    # A GGUF file for llama.cpp (options.formats ["gguf"]): llama.cpp's types per tensor for the
    # target; `engine` then carries the HIGGS defaults and is not used. Absent (false) otherwise.
    gguf: bool = False
    # GGUF jobs: options.gguf_rotate ("off" / "on" / "auto"); None (absent) = off.
    gguf_rotate: Literal["off", "on", "auto"] | None = None
    # A compressed-tensors checkpoint (options.formats ["compressed-tensors"]): vLLM's schemes
    # per linear layer for the target; of `engine` only the dtype is used. Absent (false)
    # otherwise.
    ct: bool = False

    @field_validator("engine")
    @classmethod
    def _engine_is_a_higgs_config(cls, v: dict[str, Any]) -> dict[str, Any]:
        HiggsConfig.from_dict(v)  # InvalidConfigError (a ValueError) names the bad field
        return v

    @field_validator("target")
    @classmethod
    def _one_target(cls, v: dict[str, float]) -> dict[str, float]:
        if len(v) != 1 or next(iter(v)) not in TARGET_KINDS:
            raise ValueError(f"target {v!r} must have exactly one of {list(TARGET_KINDS)}")
        value = next(iter(v.values()))
        if not math.isfinite(value):
            raise ValueError(f"target {v!r} must be a finite number")
        return v

    @classmethod
    def load(cls, data: dict[str, Any]) -> JobConfig:
        """A stored config, of any version this service ever wrote. InvalidConfigError (field
        "config") when it is none of them."""
        version = data.get("version") if isinstance(data, dict) else None
        if version != 1:
            raise InvalidConfigError(
                f"job config version {version!r} is not one this service knows (1)",
                field="config",
            )
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise InvalidConfigError(
                f"the stored job config is not valid: {e}", field="config"
            ) from e

    def to_dict(self) -> dict[str, Any]:
        d = self.model_dump(mode="json")
        if d.get("calibration") is None:
            d.pop("calibration", None)  # data-free jobs keep the shape they always had
        if d.get("menu_p") is None:
            d.pop("menu_p", None)
        if not d.get("gguf"):
            d.pop("gguf", None)
        if not d.get("ct"):
            d.pop("ct", None)
        if d.get("gguf_rotate") in (None, "off"):
            d.pop("gguf_rotate", None)
        return d

    @property
    def target_kind(self) -> str:
        return next(iter(self.target))

    @property
    def target_value(self) -> float:
        return float(next(iter(self.target.values())))

    @property
    def is_dynamic(self) -> bool:
        return self.target_kind in DYNAMIC_TARGETS

    def higgs_config(self) -> HiggsConfig:
        return HiggsConfig.from_dict(self.engine)
