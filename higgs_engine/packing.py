"""Bit-packing of integer codes into a little-endian bit stream.

Code i occupies stream bits [i*b, (i+1)*b), its least significant bit first; stream bit m is bit
(m % 8) of byte m // 8. The packed length is ceil(count * b / 8) bytes; padding bits are zero.

Fast path: 8 codes of b bits are exactly b bytes, so codes are packed 8 at a time into 64-bit
words (two words when 8 * b > 64) and the words are split into bytes, all vectorised.
`pack_codes_reference` / `unpack_codes_reference` are the slow bit-by-bit twins.
"""

from __future__ import annotations

import torch

from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError

__all__ = [
    "MAX_BITS",
    "pack_codes",
    "pack_codes_reference",
    "packed_nbytes",
    "unpack_codes",
    "unpack_codes_reference",
]

MAX_BITS = 12


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise InvalidConfigError(f"bits={bits!r} must be an integer in 1..{MAX_BITS}")


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes needed for `count` codes of `bits` bits."""
    return (count * bits + 7) // 8


def _byte_slices(bits: int) -> list[tuple[int, int, int]]:
    """For a group of 8 codes: (word, shift, byte) for each of its `bits` output bytes."""
    return [(j // 8, 8 * (j % 8), j) for j in range(bits)]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integer codes (< 2**bits, any shape, flattened) into a uint8 stream."""
    _check_bits(bits)
    flat = codes.reshape(-1)
    if flat.dtype.is_floating_point or flat.dtype == torch.bool:
        raise InvalidConfigError(f"codes must be an integer tensor, got {flat.dtype}")
    count = flat.numel()
    nbytes = packed_nbytes(count, bits)
    if count == 0:
        return torch.zeros(0, dtype=torch.uint8)
    c = flat.to(torch.int64)
    lo, hi = int(c.min()), int(c.max())
    if lo < 0 or hi >= 1 << bits:
        bad = lo if lo < 0 else hi
        raise InvalidConfigError(f"code {bad} does not fit in {bits} bits")
    if bits == 8:
        return c.to(torch.uint8)
    groups = (count + 7) // 8
    if groups * 8 != count:
        c = torch.cat([c, c.new_zeros(groups * 8 - count)])
    g = c.view(groups, 8)  # (groups, 8)
    # Assemble the 8*bits-bit group value in 64-bit words (little-endian across words).
    nwords = (8 * bits + 63) // 64
    words = [torch.zeros(groups, dtype=torch.int64) for _ in range(nwords)]
    for k in range(8):
        off = k * bits
        w, s = divmod(off, 64)
        words[w] |= g[:, k] << s
        if s + bits > 64:  # the code straddles two words
            words[w + 1] |= g[:, k] >> (64 - s)
    out = torch.empty(groups, bits, dtype=torch.uint8)  # (groups, bytes per group)
    for w, shift, j in _byte_slices(bits):
        out[:, j] = ((words[w] >> shift) & 0xFF).to(torch.uint8)
    return out.reshape(-1)[:nbytes]


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack_codes`: the first `count` codes as int64."""
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise CorruptCheckpointError(
            f"packed codes must be a 1-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    need = packed_nbytes(count, bits)
    if count < 0 or packed.numel() != need:
        raise CorruptCheckpointError(
            f"packed codes hold {packed.numel()} bytes, expected {need} for {count} codes of {bits} bits"
        )
    if count == 0:
        return torch.zeros(0, dtype=torch.int64)
    if bits == 8:
        return packed.to(torch.int64)
    groups = (count + 7) // 8
    full = groups * bits
    b = packed.to(torch.int64)
    if full != need:
        b = torch.cat([b, b.new_zeros(full - need)])
    b = b.view(groups, bits)  # (groups, bytes per group)
    nwords = (8 * bits + 63) // 64
    words = [torch.zeros(groups, dtype=torch.int64) for _ in range(nwords)]
    for w, shift, j in _byte_slices(bits):
        words[w] |= b[:, j] << shift
    mask = (1 << bits) - 1
    out = torch.empty(groups, 8, dtype=torch.int64)
    for k in range(8):
        off = k * bits
        w, s = divmod(off, 64)
        # >> on int64 is arithmetic; the mask drops the sign-extended bits.
        v = words[w] >> s
        if s + bits > 64:
            v = (v & ((1 << (64 - s)) - 1)) | (words[w + 1] << (64 - s))
        out[:, k] = v & mask
    return out.reshape(-1)[:count]


def pack_codes_reference(codes: list[int], bits: int) -> bytes:
    """Slow twin: writes the stream bit by bit."""
    nbytes = packed_nbytes(len(codes), bits)
    out = bytearray(nbytes)
    for i, code in enumerate(codes):
        for k in range(bits):
            if (code >> k) & 1:
                m = i * bits + k
                out[m // 8] |= 1 << (m % 8)
    return bytes(out)


def unpack_codes_reference(data: bytes, bits: int, count: int) -> list[int]:
    """Slow twin of `unpack_codes`: reads the stream bit by bit."""
    codes = []
    for i in range(count):
        v = 0
        for k in range(bits):
            m = i * bits + k
            v |= ((data[m // 8] >> (m % 8)) & 1) << k
        codes.append(v)
    return codes
