"""Fast Walsh-Hadamard rotation vs its explicit-matrix float64 twin."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from higgs_engine.errors import InvalidConfigError
from higgs_engine.hadamard import (
    block_layout,
    fht,
    fht_reference,
    hadamard_matrix,
    random_signs,
    rotate,
    rotate_reference,
    unrotate,
)

EPS32 = torch.finfo(torch.float32).eps


def _bound(x: torch.Tensor, h: int) -> torch.Tensor:
    """Rounding-error bound per row for a float32 transform of size h: each output is a sum of
    h terms of magnitude |x_i| / sqrt(h), so its error is at most ~ log2(h) eps ||x||_1/sqrt(h);
    a factor 4 of slack covers the two matmul stages."""
    k = max(1, h.bit_length() - 1)
    return 4 * k * EPS32 * x.abs().sum(-1, keepdim=True) / h**0.5 + 1e-30


@pytest.mark.parametrize(
    ("width", "block", "expected"),
    [
        (576, 1024, [512, 64]),
        (1536, 1024, [1024, 512]),
        (640, 1024, [512, 128]),
        (1000, 1024, [512, 256, 128, 64, 32, 8]),
        (4096, 1024, [1024] * 4),
        (3000, 1024, [1024, 1024, 512, 256, 128, 32, 16, 8]),
        (576, 64, [64] * 9),
        (7, 1024, [4, 2, 1]),
    ],
)
def test_block_layout(width: int, block: int, expected: list[int]) -> None:
    assert block_layout(width, block) == expected


@given(st.integers(1, 20000), st.sampled_from([64, 256, 1024, 4096]))
def test_block_layout_properties(width: int, block: int) -> None:
    layout = block_layout(width, block)
    assert sum(layout) == width
    assert all(h & (h - 1) == 0 and h <= block for h in layout)
    assert layout == sorted(layout, reverse=True)
    # Below the max block each size appears at most once (binary decomposition, no padding).
    small = [h for h in layout if h < block]
    assert len(small) == len(set(small))


@pytest.mark.parametrize(("width", "block"), [(0, 1024), (-3, 1024), (576, 1000), (576, 0)])
def test_block_layout_rejects(width: int, block: int) -> None:
    with pytest.raises(InvalidConfigError, match=str(width) if width <= 0 else str(block)):
        block_layout(width, block)


def test_hadamard_matrix_orthonormal_sylvester() -> None:
    h = hadamard_matrix(8)
    assert torch.allclose(h @ h.T, torch.eye(8, dtype=torch.float64), atol=1e-15)
    assert torch.equal(h, h.T)
    # Sylvester order: first row all positive, row 1 alternates.
    assert torch.all(h[0] > 0)
    assert torch.equal(torch.sign(h[1]), torch.tensor([1.0, -1] * 4, dtype=torch.float64))


@pytest.mark.parametrize("h", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
def test_fht_matches_reference(h: int) -> None:
    g = torch.Generator().manual_seed(h)
    x = torch.randn(7, h, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    fast = fht(x)
    ref = fht_reference(x)
    assert fast.dtype == torch.float32
    assert torch.all((fast.double() - ref).abs() <= _bound(x.double(), h))


def test_fht_float64_is_near_exact() -> None:
    x = torch.randn(3, 1024, dtype=torch.float64)
    assert torch.allclose(fht(x), fht_reference(x), atol=1e-12)


def test_fht_rejects_non_power_of_two() -> None:
    with pytest.raises(InvalidConfigError, match="576"):
        fht(torch.zeros(2, 576))


@pytest.mark.parametrize("width", [576, 1536, 640, 1000, 4096 + 8])
@pytest.mark.parametrize("seed", [None, 7])
def test_rotate_matches_reference_on_odd_widths(width: int, seed: int | None) -> None:
    layout = block_layout(width, 1024)
    signs = None if seed is None else random_signs(width, seed)
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(width))
    fast = rotate(x, layout, signs)
    ref = rotate_reference(x, layout, signs)
    start = 0
    for h in layout:
        sl = slice(start, start + h)
        assert torch.all((fast[:, sl].double() - ref[:, sl]).abs() <= _bound(x[:, sl].double(), h))
        start += h


@settings(max_examples=40, deadline=None)
@given(
    width=st.integers(1, 3000),
    block=st.sampled_from([64, 128, 1024]),
    rows=st.integers(1, 4),
    seed=st.one_of(st.none(), st.integers(0, 2**31 - 1)),
)
def test_rotate_random_sizes(width: int, block: int, rows: int, seed: int | None) -> None:
    layout = block_layout(width, block)
    signs = None if seed is None else random_signs(width, seed)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(width))
    fast = rotate(x, layout, signs)
    ref = rotate_reference(x, layout, signs)
    start = 0
    for h in layout:
        sl = slice(start, start + h)
        assert torch.all((fast[:, sl].double() - ref[:, sl]).abs() <= _bound(x[:, sl].double(), h))
        start += h
    back = unrotate(fast, layout, signs)
    assert torch.allclose(back, x, atol=1e-5 * float(x.abs().max()) + 1e-6)


@pytest.mark.parametrize("width", [576, 1536, 1000])
def test_unrotate_is_exact_inverse_float64(width: int) -> None:
    layout = block_layout(width, 1024)
    signs = random_signs(width, 3)
    x = torch.randn(4, width, dtype=torch.float64)
    assert torch.allclose(unrotate(rotate(x, layout, signs), layout, signs), x, atol=1e-12)
    assert torch.allclose(rotate(unrotate(x, layout, signs), layout, signs), x, atol=1e-12)


def test_rotation_preserves_norm_and_batches_leading_dims() -> None:
    layout = block_layout(1536, 1024)
    x = torch.randn(2, 3, 1536, dtype=torch.float64)
    y = rotate(x, layout)
    assert y.shape == x.shape
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.allclose(y[1, 2], rotate(x[1, 2][None], layout)[0])


def test_half_inputs_rotate_in_float32() -> None:
    layout = block_layout(576, 1024)
    x = torch.randn(2, 576).half()
    y = rotate(x, layout)
    assert y.dtype == torch.float32
    assert torch.allclose(y, rotate(x.float(), layout))


def test_random_signs_seeded() -> None:
    a = random_signs(1000, 5)
    assert torch.equal(a, random_signs(1000, 5))
    assert not torch.equal(a, random_signs(1000, 6))
    assert set(a.unique().tolist()) == {-1.0, 1.0}


def test_rotate_rejects_bad_layout_and_signs() -> None:
    x = torch.zeros(2, 576)
    with pytest.raises(InvalidConfigError, match="576"):
        rotate(x, [512, 32])
    with pytest.raises(InvalidConfigError, match="600"):
        rotate(x, [512, 64], torch.ones(600))
