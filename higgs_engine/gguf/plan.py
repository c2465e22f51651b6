"""Choosing llama.cpp's type for every tensor of a GGUF file with the linearity theorem.

1. The tensors llama.cpp quantizes (2-D weights, token embeddings and output head included; not
   norms, position or token-type embeddings), read from the converter's 16-bit file.
2. For each tensor and each type on the menu that fits its rows, the relative error
   t^2 = ||W_hat - W||^2 / ||W||^2 with llama.cpp's own quantize / dequantize (ggml kernels), on
   evenly spaced rows when the tensor is large (`sample_values` values at most: t^2 is a mean
   over rows, and a few hundred thousand values pin it to well under 1%).
3. The model's profile gives alpha per tensor (Hugging Face module names mapped to GGUF names
   with the converter's own name map); the exact DP allocator of planning.allocator picks one
   type per tensor: least predicted metric change within a bit budget counted over the WHOLE
   file (every tensor, norms included, as llama.cpp counts bits per weight), or the smallest
   file within a predicted bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from higgs_engine.errors import InfeasibleTargetError, InvalidConfigError
from higgs_engine.planning.allocator import DPTable, Problem, solve
from higgs_engine.planning.gguf_types import GGUF_MENU, GGUF_TYPES, GgufType
from higgs_engine.progress import ProgressCallback, report

DEFAULT_SAMPLE_VALUES = 1 << 18
_NOT_QUANTIZED = ("position_embd.weight", "token_types.weight")


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file (ggml order: `cols` values per row)."""

    name: str
    rows: int
    cols: int
    nbytes: int  # as stored
    dtype: str  # F16 / BF16 / F32, or the quantized type
    file: Path  # the file (shard) holding it

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def quantizable(name: str, n_dims: int) -> bool:
    """llama.cpp's rule (llama-quant.cpp, tensor_allows_quantization) for the architectures the
    service converts: 2-D weights, not norms, not position / token-type embeddings."""
    return (
        n_dims == 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and not any(name.endswith(s) for s in _NOT_QUANTIZED)
    )


@dataclass(frozen=True)
class GgufFile:
    """What the allocator needs of a GGUF file (all shards of a split one)."""

    paths: tuple[Path, ...]
    arch: str
    n_blocks: int
    tensors: tuple[GgufTensor, ...]  # the ones llama.cpp may quantize
    fixed_bytes: int  # every other tensor, as stored
    params_total: int

    @property
    def params_quantizable(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def types(self) -> dict[str, str]:
        return {t.name: t.dtype for t in self.tensors}

    @property
    def bytes_of(self) -> dict[str, int]:
        return {t.name: t.nbytes for t in self.tensors}


def read_gguf(paths: Sequence[Path] | Path, *, quantized: bool = False) -> GgufFile:
    """The tensors llama.cpp may quantize in a GGUF file (or the shards of one) and the size of
    everything else. A 16-bit file lists only its 16/32-bit float candidates; with `quantized`
    every candidate is listed whatever its type."""
    from gguf import GGUFReader

    files = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
    if not files:
        raise InvalidConfigError("no GGUF file to read")
    arch = ""
    n_blocks = 0
    tensors = []
    fixed = 0
    total = 0
    for path in files:
        r = GGUFReader(str(path))
        if not arch:
            arch = _field_str(r, "general.architecture")
            n_blocks = int(_field_int(r, f"{arch}.block_count"))
        for t in r.tensors:
            shape = [int(x) for x in t.shape]  # ggml order: ne[0] = values per row
            total += int(np.prod(shape))
            dtype = t.tensor_type.name
            if quantizable(t.name, len(shape)) and (quantized or dtype in ("F16", "BF16", "F32")):
                tensors.append(GgufTensor(t.name, shape[1], shape[0], int(t.n_bytes), dtype, path))
            else:
                fixed += int(t.n_bytes)
    return GgufFile(tuple(files), arch, n_blocks, tuple(tensors), fixed, total)


def context_length(path: Path) -> int:
    """The positions the model of a GGUF file was trained for (its `<arch>.context_length`,
    what llama.cpp reports as n_ctx_train), read from the metadata without loading the model;
    0 when the file does not say."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    f = r.get_field(f"{_field_str(r, 'general.architecture')}.context_length")
    return 0 if f is None else int(f.parts[f.data[0]][0])


def _field_str(r: Any, key: str) -> str:
    f = r.get_field(key)
    if f is None:
        raise InvalidConfigError(f"GGUF file has no {key}")
    return bytes(f.parts[f.data[0]]).decode()


def _field_int(r: Any, key: str) -> int:
    f = r.get_field(key)
    if f is None:
        raise InvalidConfigError(f"GGUF file has no {key}")
    return int(f.parts[f.data[0]][0])


def _as_float(t: Any, rows: np.ndarray | None) -> np.ndarray:
    cols = int(t.shape[0])
    kind = t.tensor_type.name
    data = np.asarray(t.data)
    if kind == "BF16":
        u16 = data.view(np.uint16).reshape(-1, cols)
        if rows is not None:
            u16 = u16[rows]
        return (u16.astype(np.uint32) << 16).view(np.float32)
    arr = data.reshape(-1, cols)
    if rows is not None:
        arr = arr[rows]
    return np.ascontiguousarray(arr, dtype=np.float32)


def sample_rows(n_rows: int, cols: int, sample_values: int) -> np.ndarray | None:
    """Evenly spaced row indices holding about `sample_values` values (None: every row)."""
    k = max(1, sample_values // max(cols, 1))
    if k >= n_rows:
        return None
    return np.unique(np.linspace(0, n_rows - 1, k).round().astype(np.int64))


def relative_errors(
    w: np.ndarray, menu: Sequence[GgufType], imatrix: np.ndarray | None = None
) -> np.ndarray:
    """t^2 of float32 rows `w` for each type of `menu` (inf where the rows do not fit)."""
    from higgs_engine.gguf.llama import roundtrip_rows

    w64 = w.astype(np.float64)
    energy = float((w64 * w64).sum())
    out = np.full(len(menu), np.inf)
    for j, t in enumerate(menu):
        if not t.fits(w.shape[1]):
            continue
        if t.keep:
            out[j] = 0.0
            continue
        d = roundtrip_rows(w, t, imatrix).astype(np.float64) - w64
        out[j] = float((d * d).sum()) / energy if energy > 0 else 0.0
    return out


def measure_errors(
    f: GgufFile,
    menu: Sequence[GgufType] = GGUF_MENU,
    *,
    sample_values: int = DEFAULT_SAMPLE_VALUES,
    threads: int = 2,
    progress: ProgressCallback | None = None,
) -> np.ndarray:
    """(tensors, types) t^2 of every quantizable tensor with every menu type (stage
    "measuring", tensors done/total). ggml's kernels release the GIL, so tensors run in
    `threads` threads."""
    from gguf import GGUFReader

    by_name = {t.name: t for p in f.paths for t in GGUFReader(str(p)).tensors}
    out = np.full((len(f.tensors), len(menu)), np.inf)
    report(progress, "measuring", 0, len(f.tensors))

    def one(i: int) -> None:
        spec = f.tensors[i]
        rows = sample_rows(spec.rows, spec.cols, sample_values)
        out[i] = relative_errors(_as_float(by_name[spec.name], rows), menu)

    done = 0
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for _ in pool.map(one, range(len(f.tensors))):
            done += 1
            report(progress, "measuring", done, len(f.tensors))
    return out


# ---------------------------------------------------------------------------------------------
# Profile alphas for GGUF tensors
# ---------------------------------------------------------------------------------------------


def gguf_names(arch: str, n_blocks: int, hf_names: Sequence[str]) -> dict[str, str]:
    """{Hugging Face module name: GGUF tensor name} with the converter's own name map (gguf-py's
    TensorNameMap); names it does not map are left out."""
    import gguf

    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in by_name:
        raise InvalidConfigError(f"gguf-py does not know the architecture {arch!r}")
    tmap = gguf.get_tensor_name_map(by_name[arch], n_blocks)
    out = {}
    for name in hf_names:
        mapped = tmap.get_name(name + ".weight", try_suffixes=(".weight",))
        if mapped is None:
            mapped = tmap.get_name(name)
        if mapped is not None:
            out[name] = mapped if mapped.endswith(".weight") else mapped + ".weight"
    return out


def tensor_alphas(f: GgufFile, alphas: dict[str, float]) -> tuple[np.ndarray, list[str]]:
    """alpha per quantizable tensor of `f` from a profile's {HF module name: alpha}. A tied
    output head shares token_embd.weight: its sensitivity is already in the embedding's
    (the Fisher gradient of a shared weight sums both uses). Returns (alphas, tensors without
    a profile entry); those get the largest alpha of any tensor (kept accurate
    rather than guessed cheap)."""
    names = gguf_names(f.arch, f.n_blocks, list(alphas))
    by_tensor: dict[str, float] = {}
    for hf, g in names.items():
        by_tensor[g] = by_tensor.get(g, 0.0) + float(alphas[hf])
    missing = [t.name for t in f.tensors if t.name not in by_tensor]
    known = [(by_tensor[t.name], t.numel) for t in f.tensors if t.name in by_tensor]
    if not known:
        raise InvalidConfigError(
            "the profile names none of the GGUF file's tensors; profile the same checkpoint"
        )
    worst = max(a for a, _ in known)
    return np.array([by_tensor.get(t.name, worst) for t in f.tensors], dtype=np.float64), missing


def build_gguf_problem(
    f: GgufFile, alphas: np.ndarray, t2: np.ndarray, menu: Sequence[GgufType] = GGUF_MENU
) -> Problem:
    """The allocator's instance: cost = bytes of each tensor in each type (inf where its rows do
    not fit), error = alpha * t^2."""
    cost = np.array(
        [
            [8.0 * t.rows * ty.row_bytes(t.cols) if ty.fits(t.cols) else np.inf for ty in menu]
            for t in f.tensors
        ],
        dtype=np.float64,
    )
    finite = np.isfinite(cost)
    error = np.where(finite, alphas[:, None] * np.where(finite, t2, 0.0), np.inf)
    return Problem(
        names=tuple(t.name for t in f.tensors),
        numel=np.array([t.numel for t in f.tensors], dtype=np.int64),
        options=tuple(menu),  # type: ignore[arg-type]
        cost_bits=cost,
        error=np.ascontiguousarray(error),
        grid_cost=np.zeros(len(menu)),
    )


@dataclass(frozen=True)
class GgufAllocation:
    types: dict[str, GgufType]  # tensor name -> type
    predicted: float  # sum of alpha * t^2 of the chosen types (the profile's metric)
    file_bits_per_weight: float  # every tensor of the file, as llama.cpp counts
    tensor_bytes: int  # quantizable tensors' bytes + the rest as stored


def allocation_of(
    f: GgufFile, problem: Problem, choice: Sequence[int], menu: Sequence[GgufType]
) -> GgufAllocation:
    types = {t.name: menu[j] for t, j in zip(f.tensors, choice, strict=True)}
    qbytes = sum(t.rows * types[t.name].row_bytes(t.cols) for t in f.tensors)
    idx = np.arange(len(choice))
    predicted = float(math.fsum(problem.error[idx, np.asarray(choice)].tolist()))
    total = qbytes + f.fixed_bytes
    return GgufAllocation(types, predicted, 8.0 * total / f.params_total, total)


def allocate_gguf(
    f: GgufFile,
    problem: Problem,
    menu: Sequence[GgufType] = GGUF_MENU,
    *,
    avg_bits: float | None = None,
    max_predicted: float | None = None,
    resolution: float = 1e-4,
) -> GgufAllocation:
    """Least predicted change with the whole file at most `avg_bits` bits per weight, or the
    smallest file whose predicted change is at most `max_predicted`."""
    if (avg_bits is None) == (max_predicted is None):
        raise InvalidConfigError("give exactly one of avg_bits and max_predicted")
    q = f.params_quantizable
    if avg_bits is not None:
        # the budget of the quantizable tensors, per quantizable weight
        per_q = (avg_bits * f.params_total - 8.0 * f.fixed_bytes) / q
        lo = (problem.min_avg_bits() * q + 8.0 * f.fixed_bytes) / f.params_total
        if per_q < problem.min_avg_bits() - 1e-12:
            raise InfeasibleTargetError(
                f"avg_bits={avg_bits:g} is below the smallest GGUF file for this model "
                f"({lo:.3f} bits per weight with every tensor in its cheapest type)"
            )
        table: DPTable = solve(problem, min(per_q, problem.max_avg_bits()), resolution)
        alloc = table.allocate(min(per_q, problem.max_avg_bits()))
    else:
        assert max_predicted is not None
        table = solve(problem, None, resolution)
        alloc = table.smallest_within(max_predicted)
    return allocation_of(f, problem, alloc.choice, menu)


def uniform_allocation(
    f: GgufFile, problem: Problem, t: GgufType, menu: Sequence[GgufType] = GGUF_MENU
) -> GgufAllocation:
    """Every tensor in `t`, or llama.cpp's fallback for rows `t` does not fit."""
    from higgs_engine.planning.gguf_types import type_for_row

    pos = {ty.name: j for j, ty in enumerate(menu)}
    choice = []
    for spec in f.tensors:
        ty = type_for_row(t, spec.cols)
        if ty.name not in pos:
            ty = GGUF_TYPES["F16"]
        choice.append(pos[ty.name])
    return allocation_of(f, problem, choice, menu)
