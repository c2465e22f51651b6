"""quantize_matrix / dequantize_matrix / higgs_matmul and the nearest-point search."""

from __future__ import annotations

import json
import math

import pytest
import torch

from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError
from higgs_engine.grids import get_grid, grid_mse
from higgs_engine.hadamard import block_layout
from higgs_engine.nearest import build_lookup, nearest_points_brute
from higgs_engine.planning.config import MatrixSpec
from higgs_engine.quantize import (
    QuantizedMatrix,
    dequantize_matrix,
    group_lengths,
    higgs_matmul,
    nearest_points,
    nearest_points_reference,
    quantize_matrix,
    relative_error,
    rotated_weight,
)


def _gauss(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _student_t(shape: tuple[int, int], df: float, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.distributions.StudentT(df).sample(shape)


def _sqdist(z: torch.Tensor, grid: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return (z.double() - grid.double()[idx]).square().sum(-1)


def _assert_nearest_ok(
    z: torch.Tensor, grid: torch.Tensor, fast: torch.Tensor, ties: bool = False
) -> None:
    """Fast and reference agree; where they differ it is a near-tie: same distance to rounding."""
    ref = nearest_points_reference(z, grid)
    diff = fast != ref
    if diff.any():
        df = _sqdist(z[diff], grid, fast[diff])
        dr = _sqdist(z[diff], grid, ref[diff])
        scale = 1.0 + z[diff].double().square().sum(-1)
        assert torch.all(df - dr <= 1e-5 * scale), (df - dr).max()
    if not ties:  # random inputs: near-ties are rare, at most a handful per 100k
        assert int(diff.sum()) <= max(2, z.shape[0] // 20000)


# ----------------------------------------------------------------------------- nearest points


@pytest.mark.parametrize(
    ("p", "n"), [(1, 2), (1, 16), (1, 256), (2, 4), (2, 16), (2, 64), (2, 256), (2, 1024)]
)
def test_nearest_points_fast_matches_reference(p: int, n: int) -> None:
    grid = get_grid(p, n)
    g = torch.Generator().manual_seed(n)
    z = torch.randn(60_000, p, generator=g)
    z[:1000] *= 4  # tails and points outside the lookup table
    _assert_nearest_ok(z, grid, nearest_points(z, grid))


def test_nearest_points_on_grid_points_and_midpoints() -> None:
    grid = get_grid(2, 256)
    assert torch.equal(nearest_points(grid, grid), torch.arange(256))
    # Exact midpoints between pairs of points are ties: any nearest index is acceptable.
    i, j = torch.arange(0, 200), torch.arange(1, 201)
    mids = (grid[i] + grid[j]) / 2
    _assert_nearest_ok(mids, grid, nearest_points(mids, grid), ties=True)
    grid1 = get_grid(1, 16)
    mids1 = (grid1[1:] + grid1[:-1]) / 2
    _assert_nearest_ok(mids1, grid1, nearest_points(mids1, grid1), ties=True)


def test_nearest_points_brute_and_other_p() -> None:
    g = torch.Generator().manual_seed(1)
    grid = torch.randn(32, 3, generator=g)
    z = torch.randn(5000, 3, generator=g)
    _assert_nearest_ok(z, grid, nearest_points(z, grid))
    _assert_nearest_ok(z, grid, nearest_points_brute(z, grid))


def test_lookup_table_cells_are_sound() -> None:
    # Every unique cell's centre and corners must map to the stored point by brute force.
    grid = get_grid(2, 64)
    lut = build_lookup(grid)
    assert 0 < lut.ambiguous_fraction < 0.2
    cells = lut.cells
    iy, ix = torch.meshgrid(torch.arange(cells), torch.arange(cells), indexing="ij")
    t = lut.table.reshape(cells, cells).long()
    uniq = t >= 0
    # Ambiguous cells: every point's true nearest is in the cell's candidate list.
    amb = ~uniq
    for dx, dy in ((0.5, 0.5), (0.0, 0.0), (1.0, 1.0), (0.3, 0.8)):
        pts = torch.stack(
            [lut.lo + lut.cell * (ix[amb] + dx), lut.lo + lut.cell * (iy[amb] + dy)], 1
        )
        ref = nearest_points_reference(pts.double(), grid)
        cand = lut.candidates[-1 - t[amb]]
        assert torch.all((cand == ref[:, None]).any(1))
    for dx, dy in ((0.5, 0.5), (0.01, 0.01), (0.99, 0.99), (0.01, 0.99), (0.99, 0.01)):
        pts = torch.stack(
            [lut.lo + lut.cell * (ix[uniq] + dx), lut.lo + lut.cell * (iy[uniq] + dy)], 1
        ).double()
        ref = nearest_points_reference(pts, grid)
        assert torch.equal(ref, t[uniq].long())


def test_nearest_points_rejects_shape_mismatch() -> None:
    with pytest.raises(InvalidConfigError, match=r"\(5, 3\)"):
        nearest_points(torch.zeros(5, 3), get_grid(2, 16))


# ----------------------------------------------------------------------------- quantize


@pytest.mark.parametrize(
    ("shape", "p", "n", "g", "h", "seed"),
    [
        ((64, 576), 2, 256, 256, 1024, None),
        ((48, 1536), 1, 16, 128, 1024, 3),
        ((40, 1000), 2, 64, 256, 1024, None),
        ((16, 640), 2, 512, 64, 256, 11),
        ((9, 96), 1, 4, 256, 64, None),
        ((8, 6), 2, 16, 4, 64, None),
        ((5, 7), 1, 2, 2, 64, 1),
    ],
)
def test_quantize_round_trip_and_matmul(
    shape: tuple[int, int], p: int, n: int, g: int, h: int, seed: int | None
) -> None:
    W = _gauss(shape, seed=7) * 0.02
    q = quantize_matrix(W, MatrixSpec(p, n, group_size=g, rotation_block=h, sign_seed=seed))
    assert q.layout == block_layout(shape[1], h)
    assert q.scales.dtype == torch.float16
    assert q.scales.shape == (shape[0], len(group_lengths(q.layout, g)))
    W_hat = dequantize_matrix(q)
    assert W_hat.shape == W.shape and W_hat.dtype == torch.float32
    # Deterministic.
    q2 = quantize_matrix(W, MatrixSpec(p, n, group_size=g, rotation_block=h, sign_seed=seed))
    assert torch.equal(q.codes, q2.codes) and torch.equal(q.scales, q2.scales)
    # higgs_matmul = x @ W_hat^T
    x = _gauss((3, shape[1]), seed=1)
    ref = x.double() @ W_hat.double().T
    got = higgs_matmul(x, q)
    assert got.shape == (3, shape[0])
    assert torch.allclose(got.double(), ref, atol=1e-4 * float(ref.abs().max()) + 1e-7)
    # relative error in a sane range for the grid (small shapes: loose)
    assert relative_error(W, W_hat) < 4 * grid_mse(p, n) + 0.02


def test_reference_pipeline_twin() -> None:
    """quantize_matrix equals a direct float64 re-derivation with the reference search."""
    from higgs_engine.hadamard import rotate_reference

    W = _gauss((16, 576), seed=3)
    p, n, gsz = 2, 256, 128
    q = quantize_matrix(W, MatrixSpec(p, n, group_size=gsz, sign_seed=None, scale_rule="rms"))
    y = rotate_reference(W, q.layout)  # (16, 576) float64
    lens = group_lengths(q.layout, gsz)
    s = q.scales.double()
    # scales are the fp16 RMS of each group
    idx = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    rms = torch.stack([y[:, idx == k].square().mean(1).sqrt() for k in range(len(lens))], 1)
    assert torch.allclose(s, rms.to(torch.float16).double())
    z = (y / s[:, idx]).reshape(-1, p)
    grid = get_grid(p, n)
    from higgs_engine.packing import unpack_codes

    codes = unpack_codes(q.codes, 8, q.num_codes)
    _assert_nearest_ok(z.float(), grid, codes)


def test_higgs_matmul_batched_and_half() -> None:
    W = _gauss((32, 576), seed=2)
    q = quantize_matrix(W, MatrixSpec(2, 256, sign_seed=5))
    W_hat = dequantize_matrix(q)
    x = _gauss((6, 576), seed=9).reshape(2, 3, 576)
    y = higgs_matmul(x, q, rotated_weight(q))
    assert y.shape == (2, 3, 32)
    assert torch.allclose(y, x @ W_hat.T, atol=1e-4)
    yh = higgs_matmul(x.half(), q)
    assert yh.dtype == torch.float16
    assert torch.allclose(yh.float(), x @ W_hat.T, atol=5e-2)


def test_zero_rows_and_groups() -> None:
    W = _gauss((8, 512), seed=4)
    W[2] = 0
    q = quantize_matrix(W, MatrixSpec(2, 64))
    W_hat = dequantize_matrix(q)
    assert torch.all(W_hat[2] == 0)
    assert torch.all(q.scales[2] == 0)
    assert relative_error(torch.zeros(3, 4), torch.zeros(3, 4)) == 0.0


def test_scale_invariance() -> None:
    W = _gauss((16, 512), seed=5)
    a = dequantize_matrix(quantize_matrix(W, MatrixSpec(2, 256)))
    b = dequantize_matrix(quantize_matrix(W * 1024, MatrixSpec(2, 256)))  # exact power-of-two scale
    assert torch.allclose(a * 1024, b, rtol=1e-5, atol=1e-5)


def test_input_dtypes() -> None:
    W = _gauss((8, 256), seed=6)
    a = quantize_matrix(W.half(), MatrixSpec(2, 256))
    b = quantize_matrix(W.half().float(), MatrixSpec(2, 256))
    assert torch.equal(a.codes, b.codes)
    c = quantize_matrix(W.bfloat16(), MatrixSpec(1, 16))
    assert c.scales.dtype == torch.float16


@pytest.mark.parametrize(("p", "n"), [(1, 16), (2, 256), (2, 512), (2, 64), (1, 8)])
def test_bits_per_weight_exact(p: int, n: int) -> None:
    W = _gauss((16, 576), seed=1)
    q = quantize_matrix(W, MatrixSpec(p, n, group_size=256))
    # 576 = 512 + 64 -> groups per row: 2 of 256 + 1 of 64
    expected = (16 * 576 / p * math.log2(n) + 16 * 16 * 3) / (16 * 576)
    assert q.bits_per_weight() == pytest.approx(expected, rel=1e-12)
    assert q.nbytes() == q.codes.numel() + 2 * q.scales.numel()
    W2 = _gauss((16, 1024), seed=1)
    q2 = quantize_matrix(W2, MatrixSpec(p, n, group_size=256))
    assert q2.bits_per_weight() == pytest.approx(math.log2(n) / p + 16 / 256, rel=1e-12)


def test_serialisation_round_trip_bit_exact(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    W = _gauss((24, 1000), seed=8)
    q = quantize_matrix(W, MatrixSpec(2, 512, group_size=128, sign_seed=42))
    tensors = q.to_tensors()
    meta = q.meta()
    path = tmp_path / "q.safetensors"
    save_file(tensors, str(path), metadata={"meta": json.dumps(meta)})
    loaded = load_file(str(path))
    q2 = QuantizedMatrix.from_tensors(loaded, json.loads(json.dumps(meta)))
    assert q2.meta() == meta
    assert torch.equal(q2.codes, q.codes) and torch.equal(q2.scales, q.scales)
    assert torch.equal(dequantize_matrix(q2), dequantize_matrix(q))


def test_from_tensors_rejects_corrupt() -> None:
    q = quantize_matrix(_gauss((8, 256)), MatrixSpec(2, 16))
    t, m = q.to_tensors(), q.meta()
    with pytest.raises(CorruptCheckpointError, match="bytes"):
        QuantizedMatrix.from_tensors({"codes": t["codes"][:-1], "scales": t["scales"]}, m)
    with pytest.raises(CorruptCheckpointError, match="scales"):
        QuantizedMatrix.from_tensors({"codes": t["codes"], "scales": t["scales"].float()}, m)
    with pytest.raises(CorruptCheckpointError, match="incomplete"):
        QuantizedMatrix.from_tensors({"codes": t["codes"]}, m)
    with pytest.raises(CorruptCheckpointError, match="layout"):
        QuantizedMatrix.from_tensors(t, {**m, "layout": [128]})
    with pytest.raises(CorruptCheckpointError, match="format"):
        QuantizedMatrix.from_tensors(t, {**m, "format": "other"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"p": 3, "n": 16}, "p=3"),
        ({"p": 2, "n": 100}, "n=100"),
        ({"p": 2, "n": 8192}, "n=8192"),
        ({"p": 1, "n": 512}, "n=512"),
        ({"p": 2, "n": 256, "group_size": 100}, "group_size=100"),
        ({"p": 2, "n": 256, "rotation_block": 1000}, "rotation_block=1000"),
    ],
)
def test_rejects_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidConfigError, match=match):
        quantize_matrix(_gauss((8, 576)), MatrixSpec(**kwargs))


def test_rejects_bad_inputs() -> None:
    with pytest.raises(InvalidConfigError, match=r"2-D.*\(4,\)"):
        quantize_matrix(torch.zeros(4), MatrixSpec(2, 256))
    with pytest.raises(InvalidConfigError, match=r"in_features=7.*p=2"):
        quantize_matrix(torch.zeros(4, 7), MatrixSpec(2, 256))
    W = _gauss((4, 64))
    W[1, 3] = float("nan")
    W[2, 5] = float("inf")
    with pytest.raises(InvalidConfigError, match="2 non-finite"):
        quantize_matrix(W, MatrixSpec(2, 256))
    with pytest.raises(InvalidConfigError, match="floating"):
        quantize_matrix(torch.zeros(4, 64, dtype=torch.int32), MatrixSpec(2, 256))
    with pytest.raises(InvalidConfigError, match="fp16"):
        quantize_matrix(torch.full((2, 64), 1e6), MatrixSpec(2, 256))


# ----------------------------------------------------------------------------- invariant


@pytest.mark.parametrize("shape", [(256, 576), (128, 1536)])
@pytest.mark.parametrize(("p", "n"), [(1, 8), (1, 16), (2, 64), (2, 256), (2, 1024)])
@pytest.mark.parametrize("dist", ["gauss", "t3", "t5"])
def test_relative_error_matches_grid_mse(shape: tuple[int, int], p: int, n: int, dist: str) -> None:
    W = _gauss(shape, seed=11) if dist == "gauss" else _student_t(shape, float(dist[1:]), seed=11)
    # Heavy rows and columns too: the rotation and per-group scales must absorb them.
    W = W * torch.logspace(-1, 1, shape[0])[:, None]
    q = quantize_matrix(W, MatrixSpec(p, n, sign_seed=None, scale_rule="rms"))
    t2 = relative_error(W, dequantize_matrix(q))
    assert abs(t2 / grid_mse(p, n) - 1) < 0.05, (t2, grid_mse(p, n))


@pytest.mark.gpu
def test_higgs_matmul_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    W = _gauss((64, 1536), seed=12).cuda()
    q = quantize_matrix(W, MatrixSpec(2, 256, sign_seed=3))
    x = _gauss((5, 1536), seed=13)
    ref = x @ dequantize_matrix(q).T
    w_rot = rotated_weight(q).cuda()
    got = higgs_matmul(x.cuda(), q, w_rot)
    assert got.is_cuda
    assert torch.allclose(got.cpu(), ref, atol=1e-3, rtol=1e-3)
    half = higgs_matmul(x.cuda().half(), q, w_rot)
    assert half.dtype == torch.float16
    assert torch.allclose(half.float().cpu(), ref, atol=5e-2, rtol=1e-2)


def test_primitive_defaults_are_the_pipelines_default_config() -> None:
    """quantize_matrix / gptq_higgs called with their defaults quantize exactly as the pipeline
    does with HiggsConfig() (the run core's METHODS["higgs"], calibrate_layers' GPTQ call)."""
    from higgs_engine.gptq import gptq_higgs
    from higgs_engine.methods import METHODS, Precision
    from higgs_engine.planning.config import HiggsConfig

    cfg = HiggsConfig()
    W = _student_t((24, 1536), 4.0, seed=21)
    q_default = quantize_matrix(W, MatrixSpec(cfg.p, cfg.n))
    q_pipeline = METHODS["higgs"].quantize(W, Precision(grid=(cfg.p, cfg.n)), cfg).quantized
    assert q_pipeline is not None
    assert (q_default.sign_seed, q_default.scale_rule) == (cfg.sign_seed, cfg.scale_rule)
    assert (q_default.group_size, q_default.layout) == (q_pipeline.group_size, q_pipeline.layout)
    assert torch.equal(q_default.codes, q_pipeline.codes)
    assert torch.equal(q_default.scales, q_pipeline.scales)

    x = _gauss((64, 1536), seed=22)
    hessian = 2 * x.T.double() @ x.double() / x.shape[0]
    g_default, _ = gptq_higgs(W, hessian, MatrixSpec(cfg.p, cfg.n))
    g_config, _ = gptq_higgs(
        W,
        hessian,
        MatrixSpec(
            cfg.p,
            cfg.n,
            group_size=cfg.group_size,
            rotation_block=cfg.rotation_block,
            sign_seed=cfg.sign_seed,
            scale_rule=cfg.scale_rule,
        ),
    )
    assert (g_default.sign_seed, g_default.scale_rule) == (cfg.sign_seed, cfg.scale_rule)
    assert torch.equal(g_default.codes, g_config.codes)
    assert torch.equal(g_default.scales, g_config.scales)
