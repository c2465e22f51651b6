"""Normalised Walsh-Hadamard rotation over power-of-two blocks of the input dimension.

A row of width `in_features` is covered by power-of-two blocks, largest first, never padded
(576 -> [512, 64], 1000 -> [512, 256, 128, 64, 32, 8]). Each block is rotated by H/sqrt(h)
(Sylvester order), optionally after multiplying by seeded random +-1 signs: y = Hn D x.
Hn is orthonormal and symmetric, so the inverse is x = D Hn y.

Fast path: for h = a * b, Sylvester's H_h = H_a (x) H_b, so on a row viewed as an (a, b)
matrix X, H_h x = H_a X H_b: two small matmuls, O(h (a + b)) per row, which on CPU beats a
log2(h)-step butterfly written in torch because each step would be a full memory pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch

from higgs_engine.errors import InvalidConfigError

# block_layout lives in a torch-free module (the allocator and the API use it); re-exported here.
from higgs_engine.planning.layout import block_layout, is_power_of_two

__all__ = [
    "block_layout",
    "fht",
    "fht_reference",
    "hadamard_matrix",
    "random_signs",
    "rotate",
    "rotate_reference",
    "unrotate",
]


def check_layout(layout: Sequence[int], width: int) -> None:
    if not layout or any(not is_power_of_two(int(h)) for h in layout) or sum(layout) != width:
        raise InvalidConfigError(
            f"layout {list(layout)} must be power-of-two blocks summing to the width {width}"
        )


@lru_cache(maxsize=64)
def _sylvester(h: int) -> torch.Tensor:
    """Unnormalised +-1 Hadamard matrix of size h in Sylvester order, float64 (cached)."""
    m = torch.ones(1, 1, dtype=torch.float64)
    while m.shape[0] < h:
        m = torch.cat([torch.cat([m, m], 1), torch.cat([m, -m], 1)], 0)
    return m


def hadamard_matrix(h: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The normalised Hadamard matrix H_h / sqrt(h) (symmetric, orthonormal)."""
    if not is_power_of_two(h):
        raise InvalidConfigError(f"Hadamard size {h} must be a power of two")
    return (_sylvester(h) / math.sqrt(h)).to(dtype)


@lru_cache(maxsize=128)
def _factor_matrix(h: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return hadamard_matrix(h, dtype).to(device)


def _split(h: int) -> tuple[int, int]:
    """h = a * b with a, b powers of two as equal as possible (a >= b)."""
    k = h.bit_length() - 1
    return 1 << (k - k // 2), 1 << (k // 2)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half types are rotated in float32: the rotation sums h terms and fp16 would lose bits.
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def fht(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform along the last dim (a power of two), fast path."""
    h = x.shape[-1]
    if not is_power_of_two(h):
        raise InvalidConfigError(f"last dim {h} must be a power of two for the Hadamard transform")
    out_dtype = x.dtype
    cd = _compute_dtype(x.dtype)
    y = x.to(cd)
    if h == 1:
        return y.clone().to(out_dtype)
    a, b = _split(h)
    lead = y.shape[:-1]
    ha = _factor_matrix(a, cd, str(y.device))
    hb = _factor_matrix(b, cd, str(y.device))
    # Each row as an (a, b) matrix X: Hn x = Ha X Hb. X Hb is one plain GEMM over all rows
    # (rows * a, b); Ha (X Hb) is a broadcast batched product. Both factors are symmetric.
    m = (y.reshape(-1, b) @ hb).reshape(-1, a, b)  # (rows, a, b)
    m = torch.matmul(ha, m)  # (rows, a, b)
    return m.reshape(*lead, h).to(out_dtype)


def fht_reference(x: torch.Tensor) -> torch.Tensor:
    """Slow, obviously correct twin of `fht`: explicit Hadamard matrix product in float64."""
    h = x.shape[-1]
    return x.to(torch.float64) @ hadamard_matrix(h, torch.float64).to(x.device)


def random_signs(size: int, seed: int) -> torch.Tensor:
    """Seeded random +-1 vector (float32) used as D in y = Hn D x."""
    if size <= 0:
        raise InvalidConfigError(f"sign vector size {size} must be positive")
    g = torch.Generator().manual_seed(int(seed))
    bits = torch.randint(0, 2, (size,), generator=g, dtype=torch.int64)
    return (bits * 2 - 1).to(torch.float32)


def _runs(layout: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, block size, count) for each run of equal consecutive blocks."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for h in layout:
        if runs and runs[-1][1] == h:
            s, hh, c = runs[-1]
            runs[-1] = (s, hh, c + 1)
        else:
            runs.append((start, h, 1))
        start += h
    return runs


def _blockwise_fht(x: torch.Tensor, layout: Sequence[int]) -> torch.Tensor:
    lead = x.shape[:-1]
    parts = []
    for start, h, count in _runs(layout):
        seg = x[..., start : start + h * count].reshape(*lead, count, h)  # (..., count, h)
        parts.append(fht(seg).reshape(*lead, h * count))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _check_signs(signs: torch.Tensor | None, width: int) -> None:
    if signs is not None and signs.shape != (width,):
        raise InvalidConfigError(f"signs of shape {tuple(signs.shape)} do not match width {width}")


def rotate(
    x: torch.Tensor, layout: Sequence[int], signs: torch.Tensor | None = None
) -> torch.Tensor:
    """y = Hn D x blockwise along the last dim. Returns float32 (float64 for float64 input)."""
    width = x.shape[-1]
    check_layout(layout, width)
    _check_signs(signs, width)
    y = x.to(_compute_dtype(x.dtype))
    if signs is not None:
        y = y * signs.to(y.dtype).to(y.device)
    return _blockwise_fht(y, layout)


def unrotate(
    y: torch.Tensor, layout: Sequence[int], signs: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact inverse of `rotate`: x = D Hn y blockwise along the last dim."""
    width = y.shape[-1]
    check_layout(layout, width)
    _check_signs(signs, width)
    x = _blockwise_fht(y.to(_compute_dtype(y.dtype)), layout)
    if signs is not None:
        x = x * signs.to(x.dtype).to(x.device)
    return x


def rotate_reference(
    x: torch.Tensor, layout: Sequence[int], signs: torch.Tensor | None = None
) -> torch.Tensor:
    """Slow twin of `rotate`: one block-diagonal float64 matrix over the whole width."""
    width = x.shape[-1]
    check_layout(layout, width)
    blocks = [hadamard_matrix(h, torch.float64) for h in layout]
    m: torch.Tensor = torch.block_diag(*blocks)  # type: ignore[no-untyped-call]  # symmetric
    if signs is not None:
        m = signs.to(torch.float64)[:, None] * m  # diag(signs) @ m
    # Column form y = Hb D x; for row vectors y^T = x^T D Hb^T = x^T (D Hb), Hb symmetric.
    return x.to(torch.float64) @ m
