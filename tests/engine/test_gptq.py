"""GPTQ with HIGGS grids (higgs_engine.gptq): the fast path equals its slow twin, H = I gives
data-free HIGGS, calibration lowers the output error on correlated inputs, and GPTQ int4."""

from __future__ import annotations

import pytest
import torch

from higgs_engine.baselines import rtn_quantize
from higgs_engine.errors import InvalidConfigError
from higgs_engine.gptq import (
    HessianAccumulator,
    gptq_higgs,
    gptq_higgs_many,
    gptq_higgs_reference,
    gptq_rtn,
    inverse_cholesky_upper,
    output_error,
    rotate_hessian,
)
from higgs_engine.grids import get_grid
from higgs_engine.hadamard import block_layout, random_signs, rotate
from higgs_engine.nearest import nearest_points, nearest_searcher
from higgs_engine.planning.config import MatrixSpec
from higgs_engine.quantize import dequantize_matrix, quantize_matrix

GRIDS = [(1, 16), (2, 256), (2, 64)]


def _correlated(tokens: int, width: int, seed: int) -> torch.Tensor:
    """Inputs with strongly correlated features (a random mixing matrix plus a few loud ones)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(width, width, generator=g) / width**0.5 + 0.3 * torch.eye(width)
    x = torch.randn(tokens, width, generator=g) @ mix
    x[:, :4] *= 8.0
    return x


def _hessian(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    for part in x.split(300):
        acc.add(part)
    return acc.hessian()


@pytest.fixture(scope="module")
def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # 320 = 256 + 64: two rotation blocks, a short last scale group.
    x = _correlated(1500, 320, seed=1)
    w = torch.randn(48, 320, generator=torch.Generator().manual_seed(2))
    return x, w, _hessian(x)


def test_hessian_accumulator_is_2xtx_over_tokens() -> None:
    x = torch.randn(100, 8, dtype=torch.float64)
    acc = HessianAccumulator(8)
    acc.add(x[:30].float())
    acc.add(x[30:].float())
    assert acc.tokens == 100
    torch.testing.assert_close(acc.hessian(), 2 * x.T @ x / 100, rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidConfigError, match="width 9"):
        acc.add(torch.zeros(2, 9))
    with pytest.raises(InvalidConfigError, match="no calibration inputs"):
        HessianAccumulator(8).hessian()


def test_hessian_strips_cover_the_whole_product() -> None:
    """Widths above one strip (and not a multiple of it): the mirrored upper triangle is the
    full symmetric 2 X^T X / tokens."""
    x = torch.randn(200, 2 * HessianAccumulator.STRIP + 37, dtype=torch.float64)
    acc = HessianAccumulator(x.shape[1])
    for part in x.split(70):
        acc.add(part.float())
    h = acc.hessian()
    torch.testing.assert_close(h, 2 * x.T @ x / 200, rtol=1e-4, atol=1e-4)
    assert torch.equal(h, h.T)


def test_inverse_cholesky_factor() -> None:
    """U is upper triangular with a positive diagonal and U^T U = H^-1 (the factor GPTQ uses)."""
    a = torch.randn(300, 90, dtype=torch.float64)
    h = a.T @ a / 300 + 0.1 * torch.eye(90, dtype=torch.float64)
    u = inverse_cholesky_upper(h)
    assert torch.equal(u, torch.triu(u)) and bool((torch.diagonal(u) > 0).all())
    torch.testing.assert_close(u.T @ u, torch.linalg.inv(h))
    torch.testing.assert_close(u, torch.linalg.cholesky(torch.linalg.inv(h), upper=True))


@pytest.mark.parametrize(("p", "n"), [(1, 16), (2, 256), (2, 64), (2, 8)])
def test_prepared_searcher_equals_nearest_points(p: int, n: int) -> None:
    """The sweep's searcher (tables prepared once) returns nearest_points' codes, including
    tuples far outside the lookup tables."""
    g = get_grid(p, n)
    z = torch.randn(20000, p, generator=torch.Generator().manual_seed(n)) * 1.5
    z[:40] *= 12.0
    z[40 : 40 + min(n, 20)] = g[:20] + 1e-7  # (almost) on grid points
    search = nearest_searcher(g)
    for part in z.split(977):
        assert torch.equal(search(part.T.contiguous()), nearest_points(part, g))


def test_rotated_hessian_is_the_hessian_of_rotated_inputs() -> None:
    x = torch.randn(64, 96, dtype=torch.float64)
    layout = block_layout(96, 64)
    signs = random_signs(96, 3)
    xr = rotate(x, layout, signs)
    torch.testing.assert_close(rotate_hessian(x.T @ x, layout, signs), xr.T @ xr)


@pytest.mark.parametrize(("p", "n"), GRIDS)
@pytest.mark.parametrize("sign_seed", [None, 5])
def test_fast_path_equals_reference(
    problem: tuple[torch.Tensor, torch.Tensor, torch.Tensor], p: int, n: int, sign_seed: int | None
) -> None:
    _, w, h = problem
    kw = {"group_size": 128, "rotation_block": 256, "sign_seed": sign_seed}
    # block 32: several lazy batches, a batch boundary inside every scale group.
    spec = MatrixSpec(p, n, **kw)  # type: ignore[arg-type]
    q, w_hat = gptq_higgs(w, h, spec, block=32, dtype=torch.float64)
    qr, w_ref = gptq_higgs_reference(w, h, spec)
    assert torch.equal(q.codes, qr.codes)
    assert torch.equal(q.scales, qr.scales)
    torch.testing.assert_close(w_hat, w_ref)
    # The returned W_hat is what the stored codes and scales dequantize to.
    torch.testing.assert_close(w_hat, dequantize_matrix(q), rtol=1e-5, atol=1e-5)
    # float32 (the production precision) lands on nearly the same codes.
    q32, _ = gptq_higgs(w, h, spec)
    same = (q32.codes == q.codes).float().mean().item()
    assert same > 0.95


@pytest.mark.parametrize(("p", "n"), GRIDS)
@pytest.mark.parametrize("rule", ["rms", "mse"])
def test_identity_hessian_gives_data_free_higgs(p: int, n: int, rule: str) -> None:
    w = torch.randn(40, 192, generator=torch.Generator().manual_seed(3))
    for sign_seed in (None, 7):
        q, w_hat = gptq_higgs(
            w,
            torch.eye(192),
            MatrixSpec(
                p, n, group_size=64, rotation_block=128, sign_seed=sign_seed, scale_rule=rule
            ),
            damp=0.0,
            dtype=torch.float64,
        )
        ref = quantize_matrix(
            w,
            MatrixSpec(
                p, n, group_size=64, rotation_block=128, sign_seed=sign_seed, scale_rule=rule
            ),
        )
        assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)
        assert q.meta() == ref.meta()
        torch.testing.assert_close(w_hat, dequantize_matrix(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("p", "n"), GRIDS)
def test_calibration_lowers_the_output_error(
    problem: tuple[torch.Tensor, torch.Tensor, torch.Tensor], p: int, n: int
) -> None:
    _x, w, h = problem
    x_test = _correlated(1500, 320, seed=1)[750:]  # same distribution
    _, w_hat = gptq_higgs(w, h, MatrixSpec(p, n, group_size=128, rotation_block=256))
    data_free = dequantize_matrix(
        quantize_matrix(w, MatrixSpec(p, n, group_size=128, rotation_block=256))
    )
    cal, free = output_error(x_test, w, w_hat), output_error(x_test, w, data_free)
    assert cal < 0.8 * free, (cal, free)
    # ... while bits per weight are exactly those of data-free HIGGS.
    q, _ = gptq_higgs(w, h, MatrixSpec(p, n, group_size=128, rotation_block=256))
    assert (
        q.bits_per_weight()
        == quantize_matrix(
            w, MatrixSpec(p, n, group_size=128, rotation_block=256)
        ).bits_per_weight()
    )


def test_stacked_matrices_equal_separate_sweeps(
    problem: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    _, w, h = problem
    a, b = w[:20], w[20:]
    many = gptq_higgs_many(
        [a, b], h, MatrixSpec(2, 256, group_size=128, rotation_block=256), dtype=torch.float64
    )
    for part, (q, w_hat) in zip([a, b], many, strict=True):
        q1, w1 = gptq_higgs(
            part, h, MatrixSpec(2, 256, group_size=128, rotation_block=256), dtype=torch.float64
        )
        assert torch.equal(q.codes, q1.codes) and torch.equal(q.scales, q1.scales)
        torch.testing.assert_close(w_hat, w1)


def test_gptq_int4_beats_rtn_on_the_output(
    problem: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    x, w, h = problem
    w_hat, bits = gptq_rtn(w, h, 4, 128)
    assert bits == pytest.approx(4 + 32 / 128 * 3 / (320 / 128))  # 3 groups of <= 128 per row
    rtn, _ = rtn_quantize(w, 4, 128)
    assert output_error(x, w, w_hat) < 0.8 * output_error(x, w, rtn)
    # Every row of every group holds at most 16 distinct values (a 4-bit uniform grid).
    for g0 in range(0, 320, 128):
        grp = w_hat[:, g0 : g0 + 128]
        assert max(len(torch.unique(r)) for r in grp) <= 16
    # H = I without damping: no error feedback, GPTQ is plain min-max RTN.
    w_i, _ = gptq_rtn(w, torch.eye(320), 4, 128, damp=0.0)
    torch.testing.assert_close(w_i, rtn, rtol=1e-6, atol=1e-6)


def test_bad_inputs_name_the_value() -> None:
    w = torch.randn(8, 64)
    with pytest.raises(InvalidConfigError, match=r"\(64, 64\)"):
        gptq_higgs(w, torch.eye(32), MatrixSpec(2, 256, group_size=64, rotation_block=64))
    with pytest.raises(InvalidConfigError, match="non-finite"):
        gptq_higgs(
            w,
            torch.full((64, 64), float("nan")),
            MatrixSpec(2, 256, group_size=64, rotation_block=64),
        )
    with pytest.raises(InvalidConfigError, match="damp"):
        gptq_higgs(
            w, torch.eye(64), MatrixSpec(2, 256, group_size=64, rotation_block=64), damp=-1.0
        )
    with pytest.raises(InvalidConfigError, match="block=3"):
        gptq_higgs(w, torch.eye(64), MatrixSpec(2, 256, group_size=64, rotation_block=64), block=3)
    indefinite = torch.block_diag(*[torch.tensor([[1.0, 2.0], [2.0, 1.0]])] * 32)
    with pytest.raises(InvalidConfigError, match="positive definite"):
        gptq_higgs(w, indefinite, MatrixSpec(2, 256, group_size=64, rotation_block=64), damp=0.0)
