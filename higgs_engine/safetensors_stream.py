"""A safetensors writer that streams tensors to disk one at a time.

`safetensors.torch.save_file` needs every tensor in memory at once; quantizing a large
checkpoint must not. Tensors are appended to a scratch data file as they come; `close()` writes
the header and copies the data into the final file, ordered by tensor name, so that writing the
same tensors in any order gives byte-identical files.

File format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON header ({name: {dtype, shape, data_offsets}, "__metadata__": {...}}, padded with
spaces to a multiple of 8), then the raw little-endian tensor bytes, contiguous.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_CHUNK = 16 << 20


def _st_dtype(dtype: torch.dtype) -> str:
    import torch

    table = {
        torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
        torch.uint8: "U8", torch.bool: "BOOL",
    }  # fmt: skip
    if dtype not in table:
        raise TypeError(f"dtype {dtype} cannot be stored in safetensors by this writer")
    return table[dtype]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's raw little-endian bytes (row-major)."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy().tobytes()


class StreamingSafetensorsWriter:
    """Append tensors one by one; `close()` produces `path`. Not thread-safe."""

    def __init__(self, path: Path, metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.metadata = dict(metadata or {})
        self._scratch = self.path.with_name(self.path.name + ".data")
        self._data = open(self._scratch, "wb")  # noqa: SIM115 - closed in close()/abort()
        # name -> (dtype, shape, start, end) in the scratch file
        self._entries: dict[str, tuple[str, list[int], int, int]] = {}
        self._pos = 0
        self.closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._entries:
            raise ValueError(f"tensor {name!r} written twice")
        raw = tensor_bytes(tensor)
        self._data.write(raw)
        self._entries[name] = (
            _st_dtype(tensor.dtype),
            list(tensor.shape),
            self._pos,
            self._pos + len(raw),
        )
        self._pos += len(raw)

    @property
    def nbytes(self) -> int:
        return self._pos

    def close(self) -> Path:
        self._data.close()
        header: dict[str, object] = {}
        if self.metadata:
            header["__metadata__"] = self.metadata
        order = sorted(self._entries)
        offset = 0
        for name in order:
            dtype, shape, start, end = self._entries[name]
            header[name] = {
                "dtype": dtype,
                "shape": shape,
                "data_offsets": [offset, offset + end - start],
            }
            offset += end - start
        blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        blob += b" " * (-len(blob) % 8)
        with open(self.path, "wb") as out, open(self._scratch, "rb") as src:
            out.write(struct.pack("<Q", len(blob)))
            out.write(blob)
            for name in order:
                _, _, start, end = self._entries[name]
                src.seek(start)
                left = end - start
                while left:
                    buf = src.read(min(_CHUNK, left))
                    if not buf:
                        raise OSError(f"scratch file {self._scratch} is truncated")
                    out.write(buf)
                    left -= len(buf)
        os.unlink(self._scratch)
        self.closed = True
        return self.path

    def abort(self) -> None:
        if not self._data.closed:
            self._data.close()
        if self._scratch.exists():
            os.unlink(self._scratch)
