"""Request and response bodies of the jobs API (docs/api.md). Unknown fields are refused."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from higgs_engine.planning.config import (
    DEFAULT_SCALE_RULE,
    DEFAULT_SCOPE,
    DEFAULT_SIGN_SEED,
    ScaleRule,
    Scope,
)
from higgs_engine.planning.layout import is_power_of_two

# native / dequantized: HIGGS artifacts (the default pair); gguf: one file for llama.cpp, in
# llama.cpp's own types chosen per tensor by the allocator (asked for alone).
Format = Literal["native", "dequantized", "gguf"]
_ALL_FORMATS: tuple[Format, ...] = ("native", "dequantized")
Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]
# Seeds are stored in JSON and given to torch generators: a signed 64-bit range, non-negative.
MAX_SEED = 2**63 - 1
TARGET_KINDS = ("bits", "avg_bits", "max_ppl_increase")
# A grid dimension: a strict integer (the services check it is 1 or 2 and say so).
GridDim = Annotated[int, WithJsonSchema({"type": "integer", "enum": [1, 2]})]


def _power_of_two_in(lo: int, hi: int, what: str) -> Callable[[int], int]:
    def check(v: int) -> int:
        if not lo <= v <= hi or not is_power_of_two(v):
            raise ValueError(f"{what}={v} must be a power of two in {lo}..{hi}")
        return v

    return check


def _powers_of_two(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "enum": [1 << k for k in range(hi.bit_length()) if 1 << k >= lo]}


# Scale groups and Hadamard blocks, as the engine accepts them for every grid.
GroupSize = Annotated[
    int,
    AfterValidator(_power_of_two_in(2, 4096, "group_size")),
    WithJsonSchema(_powers_of_two(2, 4096)),
]
RotationBlock = Annotated[
    int,
    AfterValidator(_power_of_two_in(64, 4096, "rotation_block")),
    WithJsonSchema(_powers_of_two(64, 4096)),
]


class Strict(BaseModel):
    """Unknown fields are refused, and types are strict: `true` is not a number, `"yes"` not
    a boolean, `4.0` not an integer (a JSON integer is a valid number)."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _exactly_one_target_schema(schema: dict[str, Any]) -> None:
    """The OpenAPI form of Target's rule, one object per kind with its one number (never
    null), so SDK generators make a union of three small types."""
    props = schema.get("properties", {})
    names = {"bits": "BitsTarget", "avg_bits": "AvgBitsTarget", "max_ppl_increase": "PplTarget"}
    variants = []
    for name in TARGET_KINDS:
        prop = dict(props.get(name, {}))
        number: dict[str, Any] = next(
            (v for v in prop.pop("anyOf", []) if v.get("type") != "null"), {}
        )
        prop.update(number)
        prop.pop("default", None)
        variants.append(
            {
                "title": names[name],
                "type": "object",
                "properties": {name: prop},
                "required": [name],
                "additionalProperties": False,
            }
        )
    description = schema.get("description", "")
    schema.clear()
    schema.update({"title": "Target", "description": description, "oneOf": variants})


# The OpenAPI patterns of model ids and revisions (app.jobs.model_ref checks the full rules).
MODEL_ID_PATTERN = r"^([A-Za-z0-9_.\-]{1,96}/)?[A-Za-z0-9_.\-]{1,96}$"
REVISION_PATTERN = r"^[A-Za-z0-9_.\-/]{1,255}$"


class ModelRef(Strict):
    id: str = Field(
        min_length=1,
        max_length=193,
        examples=["HuggingFaceTB/SmolLM2-135M"],
        json_schema_extra={"pattern": MODEL_ID_PATTERN},
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        max_length=255,
        examples=["main"],
        json_schema_extra={"pattern": REVISION_PATTERN},
    )


class Target(Strict):
    """Exactly one of the three (the others omitted, not null)."""

    model_config = ConfigDict(json_schema_extra=_exactly_one_target_schema)

    bits: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="uniform HIGGS, code bits per weight"
    )
    avg_bits: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="dynamic HIGGS: average bits, all overheads included",
    )
    max_ppl_increase: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="dynamic HIGGS: 0.05 = +5% perplexity"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            nulls = [k for k in TARGET_KINDS if k in data and data[k] is None]
            if nulls:
                raise ValueError(
                    f"target.{nulls[0]} is null; give exactly one of bits, avg_bits, "
                    "max_ppl_increase and omit the others"
                )
        return data

    @model_validator(mode="after")
    def _exactly_one(self) -> Target:
        given = [k for k in TARGET_KINDS if getattr(self, k) is not None]
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
    p: GridDim | None = Field(
        default=None, description="grid dimension (1 or 2); default: chosen from bits"
    )
    n: int | None = Field(
        default=None,
        ge=2,
        le=4096,
        description="grid size (p=1: 2..256, p=2: 4..4096, powers of two); default: chosen "
        "from bits",
    )
    group_size: GroupSize = Field(
        default=256, description="weights per scale: a power of two in 2..4096"
    )
    rotation_block: RotationBlock = Field(
        default=1024, description="Hadamard block: a power of two in 64..4096"
    )
    formats: list[Format] = Field(
        default_factory=lambda: list(_ALL_FORMATS),
        min_length=1,
        max_length=3,
        json_schema_extra={"uniqueItems": True},
        description="native and/or dequantized (HIGGS, the default pair), or gguf alone: a "
        "GGUF file for llama.cpp whose tensors take llama.cpp's own types, chosen by the "
        "allocator for the target",
    )
    evaluate: bool = False
    skip: list[str] = Field(
        default_factory=list, description="fnmatch patterns of layers kept in 16 bits"
    )
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    sign_seed: int | None = Field(
        default=DEFAULT_SIGN_SEED,
        ge=0,
        le=MAX_SEED,
        description="seed of the random signs before the Hadamard rotation; null = no signs",
    )
    scale_rule: ScaleRule = Field(
        default=DEFAULT_SCALE_RULE,
        description="how each scale group's scale is chosen: rms (the paper's), mse (the "
        "multiplier of the RMS scale with the smallest group error), unbiased (error orthogonal "
        "to the weights), mse-unbiased (both)",
    )
    scope: Scope = Field(
        default=DEFAULT_SCOPE,
        description="what HIGGS quantizes: linear (the linear layers; the token embedding and "
        "an untied output head stay 16-bit) or all (those too: at the same bits for target.bits, "
        "allocated like any layer for a dynamic target, the budget counting every quantized "
        "parameter). A gguf job always quantizes the embedding: all or omitted, not linear",
    )
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    calibration: str | None = Field(
        default=None,
        min_length=1,
        max_length=36,
        description="id of calibration text uploaded with POST /v1/calibrations: calibrated "
        "HIGGS (GPTQ with HIGGS grids), same artifact format and size",
    )
    calibration_tokens: int | None = Field(
        default=None, ge=2, le=1_000_000, description="calibration tokens (default 8192)"
    )
    gguf_rotate: Literal["off", "on", "auto"] | None = Field(
        default=None,
        description="gguf only, llama-family models: fold the norms and rotate the residual "
        "stream before converting (on), or measure both and keep the one with the lower "
        "predicted change at the target (auto); default off",
    )

    @field_validator("formats")
    @classmethod
    def _unique_formats(cls, v: list[Format]) -> list[Format]:
        dupes = sorted({f for f in v if v.count(f) > 1})
        if dupes:
            raise ValueError(f"formats must not repeat a format (got {', '.join(dupes)} twice)")
        return v


class JobCreate(Strict):
    model: ModelRef
    target: Target
    options: Options = Field(default_factory=Options)
    webhook_url: str | None = Field(
        default=None,
        min_length=1,
        max_length=2048,
        description="http(s) URL POSTed a signed JSON event when the job reaches a terminal state",
        examples=["https://example.com/hooks/higgs"],
    )


class Progress(BaseModel):
    done: int
    total: int
    fraction: float | None


class JobError(BaseModel):
    code: str
    message: str
    scratch_reclaimed_bytes: int | None = Field(
        default=None,
        description="bytes of scratch (unpublished files) of the job's stopped attempts that "
        "the worker removed; null when none was left",
    )


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
    webhook_url: str | None = None


class JobPage(BaseModel):
    data: list[JobOut]
    has_more: bool
    next: str | None


class LayerOut(BaseModel):
    name: str
    shape: list[int]
    p: int = Field(description="HIGGS grid dimension; 0 = kept in 16 bits or a GGUF tensor")
    n: int
    bits: float
    alpha: float | None
    rel_error: float | None
    bytes: int
    type: str | None = Field(
        default=None, description="llama.cpp tensor type (Q4_K, IQ4_XS, F16...) of a GGUF job"
    )


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
