"""The device-agnostic search (the GPU path), device selection, and quantizing on a device.

The CUDA parts skip on a machine without a GPU; everything else runs the very code the GPU
runs (nearest_points_matmul, quantize_matrix_full with device=...) on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from higgs_engine.device import resolve_device
from higgs_engine.errors import InvalidConfigError
from higgs_engine.grids import get_grid
from higgs_engine.nearest import (
    nearest_points,
    nearest_points_brute,
    nearest_points_matmul,
    nearest_points_reference,
)
from higgs_engine.packing import unpack_codes
from higgs_engine.planning.config import HiggsConfig, MatrixSpec
from higgs_engine.quantize import dequantize_matrix, quantize_matrix, quantize_matrix_full


def cuda(test: Any) -> Any:
    """Marked `gpu` (scripts/gpu_check selects these) and skipped without CUDA."""
    return pytest.mark.gpu(
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")(test)
    )


def _codes(q) -> torch.Tensor:
    return unpack_codes(q.codes, q.bits, q.num_codes)


@pytest.mark.parametrize(("p", "n"), [(1, 16), (1, 256), (2, 64), (2, 256), (2, 1024)])
def test_matmul_search_equals_fp64_reference(p: int, n: int) -> None:
    grid = get_grid(p, n)
    z = torch.randn(50_000, p, generator=torch.Generator().manual_seed(n + p))
    z[:500] *= 4  # the tails
    got = nearest_points_matmul(z, grid)
    ref = nearest_points_reference(z, grid)
    # The float64 re-check of the two best fp32 candidates makes it exact on random data.
    assert int((got != ref).sum()) == 0


def test_matmul_search_repairs_float32_near_ties() -> None:
    """Tuples a hair (1e-6 of the spacing) off the bisector of neighbouring grid points: fp32
    scores cannot separate the two points, the float64 re-check does."""
    grid = get_grid(2, 256).double()
    d = torch.cdist(grid, grid)
    d.fill_diagonal_(float("inf"))
    j = d.argmin(1)  # each point's nearest neighbour
    i = torch.arange(grid.shape[0])
    gen = torch.Generator().manual_seed(0)
    t = torch.rand(grid.shape[0], 40, 1, generator=gen, dtype=torch.float64) - 0.5
    normal = grid[j] - grid[i]  # (n, 2)
    along = torch.stack([-normal[:, 1], normal[:, 0]], 1)
    # Points on the bisector, slid along it a little, then nudged 1e-6 towards point i.
    z = ((grid[i] + grid[j]) / 2)[:, None] + 0.2 * t * along[:, None] - 1e-6 * normal[:, None]
    z = z.reshape(-1, 2).float()
    ref = nearest_points_reference(z, get_grid(2, 256))
    got = nearest_points_matmul(z, get_grid(2, 256))
    brute = nearest_points_brute(z, get_grid(2, 256))
    assert int((brute != ref).sum()) > 0, "the case does not exercise fp32 near-ties"
    assert torch.equal(got, ref)


def test_nearest_points_method_switch() -> None:
    grid = get_grid(2, 256)
    z = torch.randn(4000, 2, generator=torch.Generator().manual_seed(3))
    ref = nearest_points_reference(z, grid)
    assert torch.equal(nearest_points(z, grid, "matmul"), ref)
    assert int((nearest_points(z, grid, "lookup") != ref).sum()) <= 1
    with pytest.raises(InvalidConfigError, match="'kd-tree'"):
        nearest_points(z, grid, "kd-tree")


@pytest.mark.parametrize(("p", "n", "width"), [(2, 256, 1536), (1, 16, 576), (2, 64, 640)])
def test_quantize_with_matmul_search_matches_lookup(p: int, n: int, width: int) -> None:
    W = torch.randn(96, width, generator=torch.Generator().manual_seed(width))
    a = quantize_matrix(W, MatrixSpec(p, n, sign_seed=1), search="lookup")
    b = quantize_matrix(W, MatrixSpec(p, n, sign_seed=1), search="matmul", device="cpu")
    assert torch.equal(a.scales, b.scales)
    diff = int((_codes(a) != _codes(b)).sum())
    assert diff <= 2, diff  # near-ties only


def test_quantize_full_dequantized_equals_dequantize_matrix() -> None:
    W = torch.randn(72, 1000, generator=torch.Generator().manual_seed(5)) * 0.02
    q, w_hat = quantize_matrix_full(
        W, MatrixSpec(2, 256, group_size=128, rotation_block=512, sign_seed=7)
    )
    assert w_hat is not None
    assert torch.equal(w_hat, dequantize_matrix(q))
    q2, none = quantize_matrix_full(
        W, MatrixSpec(2, 256, group_size=128, rotation_block=512, sign_seed=7), dequantized=False
    )
    assert none is None and torch.equal(q2.codes, q.codes)


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto")
    for bad in ("tpu", "banana", "mps"):
        with pytest.raises(InvalidConfigError, match=repr(bad)):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(InvalidConfigError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(InvalidConfigError, match="cuda:99"):
        resolve_device("cuda:99")


def test_pipeline_refuses_unusable_device_and_leaves_nothing(
    tmp_path: Path, llama_ckpt: Path
) -> None:
    from higgs_engine.pipeline import quantize_checkpoint

    out = tmp_path / "out" / "q"
    with pytest.raises(InvalidConfigError, match="'npu'"):
        quantize_checkpoint(llama_ckpt, out, HiggsConfig.from_bits(4), device="npu")
    assert not (tmp_path / "out").exists()
    rep = quantize_checkpoint(llama_ckpt, out, HiggsConfig.from_bits(4), device="cpu")
    assert rep.metrics["device"] == "cpu"


@cuda
def test_quantize_matrix_on_cuda_matches_cpu() -> None:
    W = torch.randn(256, 1536, generator=torch.Generator().manual_seed(9))
    a, ha = quantize_matrix_full(W, MatrixSpec(2, 256, sign_seed=2))
    b, hb = quantize_matrix_full(W.cuda(), MatrixSpec(2, 256, sign_seed=2), device="cuda")
    assert hb is not None and ha is not None and not hb.is_cuda
    assert torch.equal(a.scales, b.scales)
    assert int((_codes(a) != _codes(b)).sum()) <= 2
    assert torch.allclose(ha, hb, atol=1e-5)


@cuda
def test_table_scale_search_on_cuda_matches_cpu() -> None:
    W = torch.randn(256, 1536, generator=torch.Generator().manual_seed(9))
    a, _ = quantize_matrix_full(W, MatrixSpec(2, 256, sign_seed=2, scale_rule="mse-unbiased"))
    b, _ = quantize_matrix_full(
        W, MatrixSpec(2, 256, sign_seed=2, scale_rule="mse-unbiased"), device="cuda"
    )
    # the same table on both devices: the same multipliers but where atan2 / log round a
    # tuple across a bin edge differently
    assert float((a.scales == b.scales).float().mean()) >= 0.99
    assert float((_codes(a) != _codes(b)).float().mean()) <= 0.01


@cuda
def test_pipeline_on_cuda_matches_cpu(tmp_path: Path, llama_ckpt: Path) -> None:
    from higgs_engine.pipeline import quantize_checkpoint

    cfg = HiggsConfig.from_bits(4)
    a = quantize_checkpoint(llama_ckpt, tmp_path / "cpu", cfg, device="cpu")
    b = quantize_checkpoint(llama_ckpt, tmp_path / "cuda", cfg, device="cuda")
    assert b.metrics["device"].startswith("cuda")
    for ra, rb in zip(a.layers, b.layers, strict=True):
        assert ra.name == rb.name and abs(ra.rel_error - rb.rel_error) < 1e-4


def _profile_on(ckpt: Path, device: str | None, method: str) -> Any:
    from devtools.profiles import obtain
    from higgs_engine.planning.profile import ProfileConfig

    cfg = ProfileConfig(method=method, context=24, windows=2, fisher_samples=2)
    return obtain(ckpt, cfg, device=device)


@pytest.mark.parametrize("method", ["fisher", "noise"])
def test_profile_on_an_explicit_cpu_device_is_the_default_profile(
    llama_ckpt: Path, method: str
) -> None:
    # The device path (model moved, windows moved, labels and noise drawn on the CPU) on the
    # CPU gives exactly the profile of the default path, self-generated text included.
    a = _profile_on(llama_ckpt, None, method)
    b = _profile_on(llama_ckpt, "cpu", method)
    assert a.generating_s > 0 and b.generating_s > 0
    assert a.profile.alphas() == b.profile.alphas()


@cuda
@pytest.mark.parametrize("method", ["fisher", "noise"])
def test_profile_on_cuda_matches_cpu(llama_ckpt: Path, method: str) -> None:
    # Generation and the Fisher / noise passes on the GPU: the same alphas up to rounding
    # (the text is sampled on the CPU from logits that differ only by float rounding).
    a = _profile_on(llama_ckpt, "cpu", method).profile.alphas()
    b = _profile_on(llama_ckpt, "cuda", method).profile.alphas()
    assert a.keys() == b.keys()
    for name, alpha in a.items():
        assert abs(b[name] - alpha) <= 0.05 * abs(alpha) + 1e-12, name
