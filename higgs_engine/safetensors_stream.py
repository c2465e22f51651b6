"""safetensors streamed one tensor at a time: the reader (`CheckpointReader`) and the writer.

The reader parses the headers and reads one tensor at a time into its own buffer with a plain
file read (no memory map, see its docstring), so nothing loads a whole model.

The writer: `safetensors.torch.save_file` needs every tensor in memory at once; quantizing a large
checkpoint must not. Tensors are appended to a scratch data file as they come; `close()` writes
the header and copies the data into the final file, ordered by tensor name, so that writing the
same tensors in any order gives byte-identical files.

File format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON header ({name: {dtype, shape, data_offsets}, "__metadata__": {...}}, padded with
spaces to a multiple of 8), then the raw little-endian tensor bytes, contiguous.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from higgs_engine.errors import (
    CorruptCheckpointError,
    ModelNotFoundError,
)

if TYPE_CHECKING:
    import torch

_CHUNK = 16 << 20
# The shard index of a sharded checkpoint, as transformers writes it.
SHARD_INDEX = "model.safetensors.index.json"


def read_weight_map(path: Path) -> dict[str, str] | None:
    """{tensor name: shard file} of a sharded checkpoint directory (its SHARD_INDEX), or None
    when the directory has no index (a single model.safetensors)."""
    index = Path(path) / SHARD_INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise TypeError("weight_map is not an object of names to file names")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"invalid safetensors index {str(index)!r}: {exc}") from exc
    return dict(weight_map)


def _st_dtype(dtype: torch.dtype) -> str:
    import torch

    table = {
        torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
        torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
        torch.float8_e5m2: "F8_E5M2",
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

    def names(self) -> list[str]:
        return list(self._entries)

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


_ST_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip
_ST_TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
    "U64": "uint64",
}  # fmt: skip


class CheckpointReader:
    """Tensor-by-tensor access to a directory of (possibly sharded) safetensors files.

    The safetensors headers are parsed here and each tensor is read with a plain file read into
    its own buffer. No memory map: pages of a mapped file stay resident (and count in RSS) once
    touched, so streaming a 2 GB checkpoint through mmap would look like loading all of it.
    Use as a context manager (or call close()) to release the file handles.

    `files`: read only these shards of the checkpoint (one part of a sharded source); the
    others are never opened and need not be present.
    """

    def __init__(self, path: Path, files: Sequence[str] | None = None) -> None:
        self.path = Path(path)
        files = self._files() if files is None else self._only(files)
        self._handles: dict[str, io.FileIO] = {}
        self._where: dict[str, str] = {}
        # key -> (safetensors dtype, shape, absolute start, absolute end)
        self._info: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        try:
            for name in files:
                self._open(name)
        except BaseException:
            self.close()
            raise

    def _open(self, name: str) -> None:
        fp = self.path / name
        f = open(fp, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        self._handles[name] = f
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise CorruptCheckpointError(f"safetensors file {str(fp)!r} is truncated (no header)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > min(size - 8, 256 << 20):
            raise CorruptCheckpointError(
                f"safetensors file {str(fp)!r} has an invalid header length {hlen}"
            )
        try:
            header = json.loads(f.read(hlen))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(
                f"safetensors file {str(fp)!r} has a corrupt header: {exc}"
            ) from exc
        base = 8 + hlen
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype = str(entry["dtype"])
                shape = tuple(int(d) for d in entry["shape"])
                start, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CorruptCheckpointError(
                    f"safetensors file {str(fp)!r}: bad entry for tensor {key!r}"
                ) from exc
            numel = math.prod(shape)
            if dtype not in _ST_DTYPE_BYTES or end - start != numel * _ST_DTYPE_BYTES[dtype]:
                raise CorruptCheckpointError(
                    f"safetensors file {str(fp)!r}: tensor {key!r} has dtype {dtype} shape "
                    f"{list(shape)} but {end - start} bytes"
                )
            if start < 0 or base + end > size:
                raise CorruptCheckpointError(
                    f"safetensors file {str(fp)!r} is truncated: tensor {key!r} ends at byte "
                    f"{base + end} of {size}"
                )
            if key in self._where:
                raise CorruptCheckpointError(
                    f"tensor {key!r} appears in both {self._where[key]!r} and {name!r}"
                )
            self._where[key] = name
            self._info[key] = (dtype, shape, base + start, base + end)

    def _only(self, files: Sequence[str]) -> list[str]:
        names = sorted(set(files))
        missing = [f for f in names if "/" in f or not (self.path / f).is_file()]
        if not names or missing:
            raise CorruptCheckpointError(
                f"shards {missing or names} are missing from {str(self.path)!r}"
            )
        return names

    def _files(self) -> list[str]:
        weight_map = read_weight_map(self.path)
        if weight_map is not None:
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise CorruptCheckpointError(
                    f"shards listed in {SHARD_INDEX} are missing: {missing}"
                )
            return files
        if (self.path / "model.safetensors").is_file():
            return ["model.safetensors"]
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"no *.safetensors files in {str(self.path)!r}")
        return files

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()

    def keys(self) -> list[str]:
        return list(self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._where))

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        return self._info[key][1]

    def numel(self, key: str) -> int:
        return math.prod(self._info[key][1])

    def nbytes(self, key: str) -> int:
        return self._info[key][3] - self._info[key][2]

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self._where)

    def get(self, key: str) -> torch.Tensor:
        """Read one tensor into fresh memory (nothing stays mapped)."""
        import torch

        if key not in self._where:
            raise KeyError(key)
        dtype, shape, start, end = self._info[key]
        tdtype = getattr(torch, _ST_TORCH_DTYPES[dtype])
        if end == start:
            return torch.empty(shape, dtype=tdtype)
        buf = bytearray(end - start)
        view = memoryview(buf)
        f = self._handles[self._where[key]]
        f.seek(start)
        got = 0
        while got < len(buf):
            n = f.readinto(view[got:])
            if not n:
                raise CorruptCheckpointError(
                    f"cannot read tensor {key!r} from {self._where[key]!r}: file ends early"
                )
            got += n
        return torch.frombuffer(buf, dtype=tdtype).reshape(shape)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self._where:
            yield key, self.get(key)


# ---------------------------------------------------------------------------------------------
# Config, module structure, quantizable layers
# ---------------------------------------------------------------------------------------------
