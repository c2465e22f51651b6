"""Data-free baselines in the same engine, for side-by-side comparison with HIGGS.

- rtn_quantize: round-to-nearest, asymmetric min-max per group of `group_size` consecutive
  weights of a row (GPTQ-style: fp16 scale = (max - min) / (2^b - 1), integer zero point
  round(-min / scale) stored as fp16). Bits: b + 32 / g.
- nf4_quantize: bitsandbytes' NF4 (QLoRA) code table, absmax per block of `block_size`
  consecutive weights of the flattened matrix, fp32 absmax: 4 + 32 / 64 = 4.5 bits. With
  double_quant=True the absmax values are themselves quantized like bitsandbytes'
  compress_statistics (mean subtracted, 8-bit signed dynamic map, blocks of 256 with fp32
  absmax, one fp32 offset): 4 + 8/64 + 32/(64*256) + 32/numel, about 4.127 bits.

Both return (W_hat float32 of W's shape, exact bits per weight).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from higgs_engine.errors import InvalidConfigError

__all__ = ["NF4_CODE", "dynamic_map", "nf4_quantize", "rtn_quantize"]

# The 16 NF4 values of bitsandbytes (quantiles of N(0, 1) normalised to [-1, 1], with an exact 0).
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def _check_matrix(W: torch.Tensor) -> None:
    if not isinstance(W, torch.Tensor) or W.dim() != 2 or W.numel() == 0:
        shape = tuple(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__
        raise InvalidConfigError(f"W must be a non-empty 2-D tensor, got {shape}")
    if not W.dtype.is_floating_point:
        raise InvalidConfigError(f"W must be floating point, got {W.dtype}")
    if not bool(torch.isfinite(W).all()):
        raise InvalidConfigError(f"W has {int((~torch.isfinite(W)).sum())} non-finite values")


def _rtn_groups(w: torch.Tensor, maxq: int) -> torch.Tensor:
    """Min-max RTN of (rows, groups, g) float32 groups; returns the dequantized groups."""
    lo = w.amin(-1, keepdim=True)
    hi = w.amax(-1, keepdim=True)
    scale = ((hi - lo) / maxq).to(torch.float16).to(torch.float32)
    # A constant group (hi == lo, or a range lost to fp16 underflow): scale |lo| puts lo exactly
    # one step from the zero point, so the group is reproduced; an all-zero group uses 1.
    fallback = torch.where(
        lo != 0, lo.abs().to(torch.float16).to(torch.float32), torch.ones_like(lo)
    )
    scale = torch.where(scale > 0, scale, fallback)
    zero = torch.round(-lo / scale).clamp(-65504, 65504)  # integer, exact in fp16 up to 2048
    zero = zero.to(torch.float16).to(torch.float32)
    q = torch.clamp(torch.round(w / scale + zero), 0, maxq)
    return (q - zero) * scale


def rtn_quantize(W: torch.Tensor, bits: int, group_size: int = 128) -> tuple[torch.Tensor, float]:
    """Asymmetric min-max round-to-nearest per row group. Returns (W_hat, bits per weight)."""
    _check_matrix(W)
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise InvalidConfigError(f"bits={bits!r} must be an integer in 1..8")
    if not isinstance(group_size, int) or group_size < 1:
        raise InvalidConfigError(f"group_size={group_size!r} must be a positive integer")
    rows, cols = W.shape
    g = min(group_size, cols)
    maxq = (1 << bits) - 1
    w = W.to(torch.float32)
    full = cols // g * g
    parts = [_rtn_groups(w[:, :full].reshape(rows, full // g, g), maxq).reshape(rows, full)]
    ngroups = full // g
    if full < cols:  # a shorter last group per row
        parts.append(_rtn_groups(w[:, full:].reshape(rows, 1, cols - full), maxq).reshape(rows, -1))
        ngroups += 1
    W_hat = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
    bpw = (bits * W.numel() + 32 * rows * ngroups) / W.numel()
    return W_hat, bpw


@lru_cache(maxsize=4)
def dynamic_map(total_bits: int = 8, max_exponent_bits: int = 7) -> torch.Tensor:
    """Signed dynamic (exponent + linear fraction) 8-bit map used by bitsandbytes for
    quantized statistics, sorted ascending, float32."""
    non_sign = total_bits - 1
    data: list[float] = []
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign - max_exponent_bits) + 1
        edges = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = ((edges[:-1] + edges[1:]) / 2.0).tolist()
        mag = 10.0 ** (-(max_exponent_bits - 1) + i)
        data += [mag * m for m in means] + [-mag * m for m in means]
    extra = 2 ** (non_sign - max_exponent_bits) - 1
    if extra > 0:
        edges = torch.linspace(0.1, 1, extra + 1, dtype=torch.float32)
        means = ((edges[:-1] + edges[1:]) / 2.0).tolist()
        mag = 10.0 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)
        data += [mag * m for m in means] + [-mag * m for m in means]
    data += [0.0, 1.0]
    # bitsandbytes pads the map to 2^total_bits with zeros when fewer values are generated.
    data += [0.0] * (2**total_bits - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def _blockwise_absmax_quantize(x: torch.Tensor, code: torch.Tensor, block: int) -> torch.Tensor:
    """Absmax-per-block quantization of a flat tensor onto a sorted code; returns dequantized."""
    n = x.numel()
    nb = (n + block - 1) // block
    # Zero padding leaves every block's absmax unchanged.
    xp = torch.nn.functional.pad(x, (0, nb * block - n)).reshape(nb, block)  # (blocks, block)
    absmax = xp.abs().amax(1, keepdim=True)
    # Multiply by the reciprocal, exactly as bitsandbytes does, so ties round the same way.
    scaled = torch.clamp(xp * (1.0 / absmax.clamp(min=1e-38)), -1, 1)
    mids = (code[1:] + code[:-1]) / 2
    idx = torch.bucketize(scaled, mids)  # ties go to the lower value, as bitsandbytes does
    return (code[idx] * absmax).reshape(-1)[:n]


def nf4_quantize(
    W: torch.Tensor, block_size: int = 64, double_quant: bool = False
) -> tuple[torch.Tensor, float]:
    """NF4 with absmax blocks over the flattened matrix. Returns (W_hat, bits per weight)."""
    _check_matrix(W)
    if not isinstance(block_size, int) or block_size < 1:
        raise InvalidConfigError(f"block_size={block_size!r} must be a positive integer")
    code = torch.tensor(NF4_CODE, dtype=torch.float32)
    flat = W.reshape(-1).to(torch.float32)
    n = flat.numel()
    nb = (n + block_size - 1) // block_size
    xp = torch.nn.functional.pad(flat, (0, nb * block_size - n)).reshape(nb, block_size)
    absmax = xp.abs().amax(1)  # (blocks,) fp32
    if double_quant:
        offset = absmax.mean()
        absmax = _blockwise_absmax_quantize(absmax - offset, dynamic_map(), 256) + offset
        bits = 4 * n + 8 * nb + 32 * ((nb + 255) // 256) + 32
    else:
        bits = 4 * n + 32 * nb
    scaled = torch.clamp(xp * (1.0 / absmax.clamp(min=1e-38))[:, None], -1, 1)
    mids = (code[1:] + code[:-1]) / 2
    idx = torch.bucketize(scaled, mids)
    W_hat = (code[idx] * absmax[:, None]).reshape(-1)[:n].reshape(W.shape)
    return W_hat, bits / n
