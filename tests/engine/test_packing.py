"""Bit-packing: fast vectorised path vs bit-by-bit reference, exhaustive round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError
from higgs_engine.packing import (
    pack_codes,
    pack_codes_reference,
    packed_nbytes,
    unpack_codes,
    unpack_codes_reference,
)

BITS = list(range(1, 13))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_pack_matches_reference_and_round_trips(data: st.DataObject) -> None:
    bits = data.draw(st.sampled_from(BITS))
    codes = data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=70))
    packed = pack_codes(torch.tensor(codes, dtype=torch.int64), bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(len(codes), bits)
    assert bytes(packed.tolist()) == pack_codes_reference(codes, bits)
    assert unpack_codes(packed, bits, len(codes)).tolist() == codes
    assert unpack_codes_reference(bytes(packed.tolist()), bits, len(codes)) == codes


@pytest.mark.parametrize("bits", BITS)
def test_every_code_value_round_trips(bits: int) -> None:
    # Every value, at every position modulo 8 (all alignments within a packed group).
    vals = torch.arange(1 << bits, dtype=torch.int64)
    for shift in range(8):
        codes = torch.roll(vals, shift)[: (1 << bits) - shift] if shift else vals
        packed = pack_codes(codes, bits)
        assert torch.equal(unpack_codes(packed, bits, codes.numel()), codes)
        assert bytes(packed.tolist()) == pack_codes_reference(codes.tolist(), bits)


@pytest.mark.parametrize("bits", BITS)
def test_large_random_round_trip(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (100_003,), generator=g)
    packed = pack_codes(codes, bits)
    assert packed.numel() == (100_003 * bits + 7) // 8
    assert torch.equal(unpack_codes(packed, bits, codes.numel()), codes)


def test_known_layout_little_endian() -> None:
    # 3-bit codes 1, 2, 7: stream bits 100 010 111 -> byte0 = 0b11010001, byte1 = 0b1.
    assert pack_codes(torch.tensor([1, 2, 7]), 3).tolist() == [0b11010001, 0b1]
    assert pack_codes(torch.tensor([0xABC]), 12).tolist() == [0xBC, 0x0A]


def test_accepts_any_integer_dtype_and_shape() -> None:
    codes = torch.tensor([[1, 2], [3, 0]], dtype=torch.int16)
    assert torch.equal(unpack_codes(pack_codes(codes, 2), 2, 4), codes.reshape(-1).long())


def test_empty() -> None:
    assert pack_codes(torch.zeros(0, dtype=torch.int64), 5).numel() == 0
    assert unpack_codes(torch.zeros(0, dtype=torch.uint8), 5, 0).numel() == 0


@pytest.mark.parametrize("bits", [0, 13, 2.0])
def test_rejects_bad_bits(bits: object) -> None:
    with pytest.raises(InvalidConfigError, match="bits"):
        pack_codes(torch.tensor([0]), bits)  # type: ignore[arg-type]


def test_rejects_out_of_range_codes() -> None:
    with pytest.raises(InvalidConfigError, match="8 does not fit in 3 bits"):
        pack_codes(torch.tensor([1, 8]), 3)
    with pytest.raises(InvalidConfigError, match="-1"):
        pack_codes(torch.tensor([-1]), 3)
    with pytest.raises(InvalidConfigError, match="integer"):
        pack_codes(torch.tensor([1.0]), 3)


def test_unpack_rejects_wrong_length() -> None:
    with pytest.raises(CorruptCheckpointError, match="expected 2"):
        unpack_codes(torch.zeros(3, dtype=torch.uint8), 3, 5)
    with pytest.raises(CorruptCheckpointError, match="uint8"):
        unpack_codes(torch.zeros(2, dtype=torch.int32), 3, 5)
