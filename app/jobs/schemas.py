"""Request and response bodies of the jobs API (docs/api.md). Unknown fields are refused."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Format = Literal["native", "dequantized"]
_ALL_FORMATS: tuple[Format, ...] = ("native", "dequantized")
Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelRef(Strict):
    id: str = Field(min_length=1, max_length=512, examples=["HuggingFaceTB/SmolLM2-135M"])
    revision: str | None = Field(default=None, min_length=1, max_length=255, examples=["main"])


class Target(Strict):
    """Exactly one of the three."""

    bits: float | None = Field(default=None, description="uniform HIGGS, code bits per weight")
    avg_bits: float | None = Field(
        default=None, description="dynamic HIGGS: average bits, all overheads included"
    )
    max_ppl_increase: float | None = Field(
        default=None, description="dynamic HIGGS: 0.05 = +5% perplexity"
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> Target:
        given = [
            k for k in ("bits", "avg_bits", "max_ppl_increase") if getattr(self, k) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "target must have exactly one of bits, avg_bits, max_ppl_increase"
                + (f" (got {', '.join(given)})" if given else " (got none)")
            )
        return self

    @property
    def kind(self) -> str:
        return next(
            k for k in ("bits", "avg_bits", "max_ppl_increase") if getattr(self, k) is not None
        )

    @property
    def value(self) -> float:
        v = getattr(self, self.kind)
        return float(v)


class Options(Strict):
    p: int | None = Field(
        default=None, description="grid dimension (1 or 2); default: chosen from bits"
    )
    n: int | None = Field(default=None, description="grid size; default: chosen from bits")
    group_size: int = 256
    rotation_block: int = 1024
    formats: list[Format] = Field(default_factory=lambda: list(_ALL_FORMATS), min_length=1)
    evaluate: bool = False
    skip: list[str] = Field(
        default_factory=list, description="fnmatch patterns of layers kept in 16 bits"
    )
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    sign_seed: int | None = None
    seed: int = 0


class JobCreate(Strict):
    model: ModelRef
    target: Target
    options: Options = Field(default_factory=Options)


class Progress(BaseModel):
    done: int
    total: int
    fraction: float | None


class JobError(BaseModel):
    code: str
    message: str


class ArtifactRef(BaseModel):
    format: str
    url: str
    bytes: int
    sha256: str


class JobOut(BaseModel):
    id: str
    status: Status
    stage: str | None
    progress: Progress
    cancel_requested: bool
    attempts: int
    model: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime
    request: dict[str, Any]
    config: dict[str, Any]
    error: JobError | None
    summary: dict[str, Any] | None
    stage_durations: dict[str, Any] | None
    artifacts: list[ArtifactRef]


class JobPage(BaseModel):
    data: list[JobOut]
    has_more: bool
    next: str | None


class LayerOut(BaseModel):
    name: str
    shape: list[int]
    p: int
    n: int
    bits: float
    alpha: float | None
    rel_error: float | None
    bytes: int


class LayersOut(BaseModel):
    job_id: str
    data: list[LayerOut]


class ArtifactFileOut(BaseModel):
    path: str
    bytes: int
    sha256: str
    url: str


class ArtifactOut(BaseModel):
    job_id: str
    format: str
    bytes: int
    sha256: str
    files: list[ArtifactFileOut]
    archive_url: str
