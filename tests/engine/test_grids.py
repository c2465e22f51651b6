"""Shipped Gaussian grids: golden MSE values, 4x per bit, determinism, metadata vs Monte Carlo."""

from __future__ import annotations

import pytest
import torch

from higgs_engine.errors import InvalidConfigError
from higgs_engine.grid_build import build_grid, lloyd_max_1d, p1_mse
from higgs_engine.grids import available_grids, get_grid, grid_mse
from higgs_engine.nearest import nearest_points
from higgs_engine.planning.config import SUPPORTED_GRIDS

# Lloyd-Max (Max 1960) and the HIGGS paper's 2-D grids.
P1_GOLDEN = {2: 0.3634, 4: 0.1175, 8: 0.03454, 16: 0.009497}
P2_GOLDEN = {16: 0.107, 64: 0.0295, 256: 0.0078}


def test_every_supported_grid_is_shipped() -> None:
    shipped = set(available_grids())
    for p, sizes in SUPPORTED_GRIDS.items():
        for n in sizes:
            assert (p, n) in shipped
            g = get_grid(p, n)
            assert g.shape == (n, p) and g.dtype == torch.float32
            assert torch.isfinite(g).all()
            # distinct points
            assert torch.cdist(g, g).add(torch.eye(n) * 1e9).min() > 1e-4


@pytest.mark.parametrize(("n", "mse"), sorted(P1_GOLDEN.items()))
def test_p1_golden(n: int, mse: float) -> None:
    assert grid_mse(1, n) == pytest.approx(mse, rel=0.01)


@pytest.mark.parametrize(("n", "mse"), sorted(P2_GOLDEN.items()))
def test_p2_golden(n: int, mse: float) -> None:
    assert grid_mse(2, n) == pytest.approx(mse, rel=0.03)


def test_one_more_bit_per_coordinate_cuts_mse_about_4x() -> None:
    for n in SUPPORTED_GRIDS[1][:-1]:
        ratio = grid_mse(1, n) / grid_mse(1, 2 * n)
        # Lloyd-Max ratios rise from 3.1 (n=2) towards the high-resolution limit of 4.
        assert (3.0 if n < 16 else 3.6) < ratio < 4.3, (n, ratio)
    for n in SUPPORTED_GRIDS[2]:
        if 4 * n in SUPPORTED_GRIDS[2]:
            ratio = grid_mse(2, n) / grid_mse(2, 4 * n)
            assert (3.0 if n < 16 else 3.5) < ratio < 4.3, (n, ratio)
    # Same code bits: each grid of one family is monotone in n.
    for p, sizes in SUPPORTED_GRIDS.items():
        m = [grid_mse(p, n) for n in sizes]
        assert m == sorted(m, reverse=True)


def test_vector_grid_beats_scalar_at_equal_bits() -> None:
    # p=2 n=256 vs p=1 n=16: both 4 bits per coordinate; the paper quotes ~19% lower MSE.
    gain = 1 - grid_mse(2, 256) / grid_mse(1, 16)
    assert 0.14 < gain < 0.25, gain
    assert grid_mse(2, 64) < grid_mse(1, 8)
    assert grid_mse(2, 16) < grid_mse(1, 4)


@pytest.mark.parametrize(
    ("p", "n"), [(1, 4), (1, 16), (1, 256), (2, 16), (2, 256), (2, 1024), (2, 4096)]
)
def test_stored_mse_matches_monte_carlo(p: int, n: int) -> None:
    """The metadata MSE agrees with a large fixed-seed Monte Carlo estimate."""
    g = torch.Generator().manual_seed(1234 + n)
    z = torch.randn(1_000_000 // p, p, generator=g)
    grid = get_grid(p, n)
    idx = nearest_points(z, grid)
    err = (z.double() - grid.double()[idx]).square().mean(1)  # per-coordinate error per tuple
    mc = float(err.mean())
    # Large grids are tail-dominated (one 5-sigma sample moves the mean by ~1%), so the bound
    # is the estimate's own standard error (4 sigma) plus 0.5% for the quadrature.
    stderr = float(err.std()) / err.numel() ** 0.5
    assert abs(mc - grid_mse(p, n)) <= 4 * stderr + 0.005 * grid_mse(p, n), (mc, stderr)


def test_p1_grid_is_lloyd_max_fixed_point() -> None:
    grid = get_grid(1, 16).double().squeeze(1)
    # Centroid condition: each point is the conditional mean of its cell (exact integrals).
    from higgs_engine.grid_build import _cell_moments, _p1_boundaries

    lo, hi = _p1_boundaries(grid)
    mass, m1, _ = _cell_moments(lo, hi)
    assert torch.allclose(m1 / mass, grid, atol=1e-6)
    assert torch.allclose(grid, -grid.flip(0), atol=1e-7)  # symmetric
    assert p1_mse(grid) == pytest.approx(grid_mse(1, 16), rel=1e-6)


def test_recomputed_grids_match_shipped() -> None:
    """Determinism: rebuilding small grids reproduces the package data."""
    for n in (2, 8):
        c = lloyd_max_1d(n)
        assert torch.allclose(c.float(), get_grid(1, n).squeeze(1), atol=1e-6)
    grid, mse = build_grid(2, 4)
    assert torch.allclose(grid.float(), get_grid(2, 4), atol=1e-5)
    assert mse == pytest.approx(grid_mse(2, 4), rel=1e-6)


def test_get_grid_returns_a_copy() -> None:
    g = get_grid(2, 16)
    g.zero_()
    assert get_grid(2, 16).abs().sum() > 0


@pytest.mark.parametrize(
    ("p", "n", "match"), [(3, 16, "p=3"), (1, 512, "n=512"), (2, 2, "n=2"), (2, 100, "n=100")]
)
def test_unknown_grid_rejected(p: int, n: int, match: str) -> None:
    with pytest.raises(InvalidConfigError, match=match):
        get_grid(p, n)
    with pytest.raises(InvalidConfigError, match=match):
        grid_mse(p, n)
