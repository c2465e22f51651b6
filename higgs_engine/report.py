"""What a quantization run measured: the content of report.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class LayerReport:
    name: str
    shape: list[int]  # [out_features, in_features]
    p: int  # 0 = kept in 16 bits
    n: int
    bits: float  # this layer's bits per weight, scales included
    rel_error: float  # t^2 = ||W_hat - W||^2 / ||W||^2
    bytes: int  # bytes this layer occupies in the native artifact
    alpha: float | None = None  # sensitivity from a profile, when known
    # llama.cpp tensor type of a GGUF file's tensor (p = n = 0 there); None for HIGGS layers
    type: str | None = None


@dataclass
class Report:
    # Bits per weight over the selected linear layers (those quantized and those the config or
    # the allocator kept in 16 bits), counting codes, fp16 scales and grids.
    bits_per_weight: float
    # Bits per parameter over the whole checkpoint (embeddings, norms, head included).
    bits_per_param_total: float
    bytes_before: int
    bytes_after: int
    params_total: int
    params_quantized: int
    layers: list[LayerReport]
    timings: dict[str, float]  # seconds per stage
    config: dict[str, Any]
    source: dict[str, Any]  # {"id", "revision", "architecture", "model_type"}
    versions: dict[str, str]
    seed: int
    formats: list[str]
    # Extra figures (predicted / measured metric change, profile info...).
    metrics: dict[str, Any] = field(default_factory=dict)
    report_version: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        d = dict(d)
        d["layers"] = [LayerReport(**row) for row in d["layers"]]
        return cls(**d)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))

    @classmethod
    def load(cls, path: Path) -> Report:
        return cls.from_dict(json.loads(path.read_text()))
