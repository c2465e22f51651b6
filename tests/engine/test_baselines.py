"""RTN and NF4 baselines; NF4 checked against bitsandbytes' CPU implementation."""

from __future__ import annotations

import pytest
import torch

from higgs_engine.baselines import NF4_CODE, dynamic_map, nf4_quantize, rtn_quantize
from higgs_engine.errors import InvalidConfigError


def _w(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05


def _rtn_reference(W: torch.Tensor, bits: int, g: int) -> torch.Tensor:
    """Slow twin: a Python loop over rows and groups."""
    out = torch.empty_like(W, dtype=torch.float32)
    maxq = 2**bits - 1
    for r in range(W.shape[0]):
        for c0 in range(0, W.shape[1], g):
            w = W[r, c0 : c0 + g].float()
            lo, hi = float(w.min()), float(w.max())
            scale = float(torch.tensor((hi - lo) / maxq).half())
            if scale <= 0:
                scale = float(torch.tensor(abs(lo)).half()) if lo != 0 else 1.0
            zero = float(torch.tensor(round(-lo / scale)).half())
            q = torch.clamp(torch.round(w / scale + zero), 0, maxq)
            out[r, c0 : c0 + g] = (q - zero) * scale
    return out


@pytest.mark.parametrize(
    ("shape", "bits", "g"), [((8, 256), 4, 128), ((5, 300), 3, 128), ((4, 64), 2, 128)]
)
def test_rtn_matches_loop_reference(shape: tuple[int, int], bits: int, g: int) -> None:
    W = _w(shape, seed=bits)
    W_hat, bpw = rtn_quantize(W, bits, g)
    assert torch.allclose(W_hat, _rtn_reference(W, bits, g), atol=1e-7)
    ngroups = shape[0] * -(-shape[1] // min(g, shape[1]))
    assert bpw == pytest.approx((bits * W.numel() + 32 * ngroups) / W.numel())


def test_rtn_properties() -> None:
    W = _w((64, 1024))
    W_hat, bpw = rtn_quantize(W, 4, 128)
    assert bpw == pytest.approx(4 + 32 / 128)
    # At most 16 distinct values per group, error below one step.
    grp = W_hat[0, :128]
    assert grp.unique().numel() <= 16
    step = (W[0, :128].max() - W[0, :128].min()) / 15
    assert float((W_hat[0, :128] - W[0, :128]).abs().max()) <= float(step) * 0.51 + 1e-6
    # More bits, less error.
    e = [float((rtn_quantize(W, b)[0] - W).square().mean()) for b in (2, 3, 4, 8)]
    assert e == sorted(e, reverse=True)
    # Constant groups are reproduced exactly.
    for v in (0.3, -0.3, 0.0):
        C = torch.full((2, 256), v)
        assert torch.allclose(rtn_quantize(C, 4)[0], C, atol=1e-3)


def test_nf4_properties() -> None:
    W = _w((32, 512))
    W_hat, bpw = nf4_quantize(W)
    assert bpw == pytest.approx(4.5)
    blocks = W.reshape(-1, 64)
    hat = W_hat.reshape(-1, 64)
    absmax = blocks.abs().amax(1, keepdim=True)
    # Every value is a code value times its block absmax; the absmax itself is exact.
    codes = hat / absmax
    table = torch.tensor(NF4_CODE)
    assert torch.all((codes[..., None] - table).abs().amin(-1) < 1e-6)
    assert torch.allclose(hat.abs().amax(1, keepdim=True), absmax)


def test_nf4_double_quant_bits_and_error() -> None:
    W = _w((256, 1024))
    a, _bpw_a = nf4_quantize(W)
    b, bpw_b = nf4_quantize(W, double_quant=True)
    assert bpw_b == pytest.approx(4 + 8 / 64 + 32 / (64 * 256) + 32 / W.numel())
    assert 4.12 < bpw_b < 4.13
    ea = float((a - W).square().mean())
    eb = float((b - W).square().mean())
    assert ea <= eb < 1.05 * ea


def _bnb_cpu():
    try:
        import bitsandbytes.functional as F

        probe = torch.randn(2, 64)
        q, st = F.quantize_4bit(probe, blocksize=64, quant_type="nf4")
        F.dequantize_4bit(q, st)
    except Exception as e:  # pragma: no cover - depends on the installed build
        pytest.skip(f"bitsandbytes cannot run on CPU here: {e}")
    return F


@pytest.mark.parametrize("shape", [(64, 576), (33, 100), (128, 1536)])
def test_nf4_matches_bitsandbytes_cpu(shape: tuple[int, int]) -> None:
    F = _bnb_cpu()
    W = _w(shape, seed=shape[1])
    W[0, :5] = torch.tensor([0.0, 1.0, -1.0, 0.5, -0.5])  # exact values and an absmax hit
    q, st = F.quantize_4bit(W, blocksize=64, quant_type="nf4")
    ref = F.dequantize_4bit(q, st).float()
    ours, _ = nf4_quantize(W, 64)
    assert torch.equal(ours, ref), float((ours - ref).abs().max())


def test_nf4_double_quant_close_to_bitsandbytes() -> None:
    F = _bnb_cpu()
    W = _w((256, 1024), seed=3)
    q, st = F.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
    ref = F.dequantize_4bit(q, st).float()
    ours, _ = nf4_quantize(W, 64, double_quant=True)
    e_ref = float((ref - W).square().mean())
    e_ours = float((ours - W).square().mean())
    assert abs(e_ours / e_ref - 1) < 0.02
    # Almost all values identical (absmax rounding may differ in the last bit).
    assert float((ours == ref).float().mean()) > 0.95


def test_dynamic_map_shape() -> None:
    m = dynamic_map()
    assert m.numel() == 256 and torch.all(m[1:] >= m[:-1])
    assert float(m.max()) == 1.0 and float(m.min()) > -1.0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: rtn_quantize(torch.zeros(4), 4), r"2-D"),
        (lambda: rtn_quantize(torch.zeros(4, 4), 9), "bits=9"),
        (lambda: rtn_quantize(torch.zeros(4, 4), 4, 0), "group_size=0"),
        (lambda: nf4_quantize(torch.zeros(4, 4), 0), "block_size=0"),
        (lambda: nf4_quantize(torch.full((2, 2), float("nan"))), "non-finite"),
    ],
)
def test_baselines_reject_bad_input(call, match: str) -> None:
    with pytest.raises(InvalidConfigError, match=match):
        call()
