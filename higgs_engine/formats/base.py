"""The FormatWriter interface, and what every format's small files share.

A format writer streams one artifact format into its own directory: one safetensors weight
file written tensor by tensor (`WEIGHTS_NAME`, ordered by name when closed), then, in
`finish`, config.json and the source's tokenizer files. ArtifactWriter (higgs_engine.artifacts)
fans every tensor of a run out to the writers of the formats a config names; the writers of
one part of a sharded run only close their weight file (`finish_part`), and the assembly
(higgs_engine.parts) writes the small files through the same classmethods.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from higgs_engine.errors import CorruptCheckpointError, ModelNotFoundError
from higgs_engine.safetensors_stream import StreamingSafetensorsWriter
from higgs_engine.sources import tokenizer_files

if TYPE_CHECKING:
    import torch

    from higgs_engine.model_structure import LayerSpec
    from higgs_engine.quantize import QuantizedMatrix

__all__ = [
    "ST_METADATA",
    "WEIGHTS_NAME",
    "FormatWriter",
    "read_config_json",
    "torch_dtype",
    "write_configs",
    "write_json",
]

WEIGHTS_NAME = "model.safetensors"
ST_METADATA = {"format": "pt"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an artifact dtype name ("float16", "bfloat16", "float32")."""
    import torch

    table = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if name not in table:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in an artifact config")
    return table[name]


def read_config_json(path: Path) -> dict[str, Any]:
    """The config.json of the checkpoint directory `path`, as a JSON object."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except FileNotFoundError as exc:
        raise ModelNotFoundError(f"no config.json in {str(path)!r}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{str(path / 'config.json')!r} is not valid JSON: {exc}"
        ) from exc
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{str(path / 'config.json')!r} is not a JSON object")
    return raw


def _with_dtype(raw: dict[str, Any], dtype: str) -> dict[str, Any]:
    out = {k: v for k, v in raw.items() if k != "quantization_config"}
    out["dtype"] = dtype
    if "torch_dtype" in out:
        out["torch_dtype"] = dtype
    return out


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_configs(
    fmt_dir: Path, source_dir: Path, dtype: str, quant_config: dict[str, Any] | None
) -> None:
    """config.json (the source's, with `dtype` and, when given, `quant_config` as its
    "quantization_config") and the source's tokenizer files into one format directory."""
    cfg = _with_dtype(read_config_json(source_dir), dtype)
    if quant_config is not None:
        cfg["quantization_config"] = quant_config
    write_json(fmt_dir / "config.json", cfg)
    for f in tokenizer_files(source_dir):
        shutil.copy2(f, fmt_dir / f.name)


class FormatWriter(ABC):
    """One artifact format, streamed into `fmt_dir` (created here; it must not exist).

    Subclasses name the format (`name`, the key of higgs_engine.formats.FORMATS), say whether
    it carries the HIGGS grids (`carries_grids`: the grid tensors go into the weight file of a
    single-file run and into one extra shard of an assembled sharded artifact), and write a
    quantized layer (`add_quantized`). Tensors that are not quantized arrive through
    `add_plain`, already cast to the run's dtype. `write_configs` writes the format's small
    files (config.json, tokenizer files); override it for a config of the format's own.
    """

    name: ClassVar[str]
    carries_grids: ClassVar[bool] = False

    def __init__(self, fmt_dir: Path, dtype: str, source_dir: Path) -> None:
        self.dir = fmt_dir
        self.dtype = dtype
        self.source_dir = source_dir
        fmt_dir.mkdir(parents=True, exist_ok=False)
        self._weights = StreamingSafetensorsWriter(fmt_dir / WEIGHTS_NAME, ST_METADATA)

    @classmethod
    def shard_count(cls, n_parts: int, with_grids: bool) -> int:
        """Weight shards of this format in an artifact assembled from `n_parts` parts (one per
        part, plus the grids shard when the format carries grids and a layer is quantized)."""
        return n_parts + 1 if cls.carries_grids and with_grids else n_parts

    @classmethod
    def write_configs(
        cls, fmt_dir: Path, source_dir: Path, dtype: str, quant_config: dict[str, Any]
    ) -> None:
        """The format's small files: by default the source's config.json with `dtype` (no
        quantization_config) and its tokenizer files."""
        write_configs(fmt_dir, source_dir, dtype, None)

    def add_plain(self, key: str, tensor: torch.Tensor) -> None:
        """Write a tensor under `key` as it is (a non-quantized tensor, or a grid)."""
        self._weights.add(key, tensor)

    @abstractmethod
    def add_quantized(
        self, spec: LayerSpec, q: QuantizedMatrix | None, w_hat: torch.Tensor
    ) -> None:
        """Write one quantized layer: its native encoding `q` (None when the method has none)
        and W_hat, the dequantized (out, in) float32 weight."""

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in the run's dtype when floating point."""
        return t.to(torch_dtype(self.dtype)) if t.is_floating_point() else t

    @property
    def nbytes(self) -> int:
        """Tensor bytes written so far."""
        return self._weights.nbytes

    def tensor_names(self) -> list[str]:
        """Names of the tensors written, sorted (the weight file's order)."""
        return sorted(self._weights.names())

    def finish_part(self) -> int:
        """Close the weight file of one part of a sharded run (the assembly writes the small
        files). Returns its tensor bytes."""
        nbytes = self._weights.nbytes
        self._weights.close()
        return nbytes

    def finish(self, quant_config: dict[str, Any]) -> None:
        """Close the weight file and write the small files; `quant_config` is the run's
        quantization_config (higgs_engine.formats.native.quantization_config)."""
        self._weights.close()
        self.write_configs(self.dir, self.source_dir, self.dtype, quant_config)

    def abort(self) -> None:
        """Drop what was written (the weight file and its scratch data)."""
        with contextlib.suppress(OSError):
            self._weights.abort()
