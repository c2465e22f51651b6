"""GPTQ in vLLM's compressed-tensors schemes, in the layer's column order and in activation
order: the fast sweep equals its float64 reference twin, an identity Hessian gives the data-free
layer back, correlated inputs get a lower output error than the data-free layer, activation
order keeps the data-free scales, and the library's decompression is our dequantization
exactly."""

from __future__ import annotations

import pytest
import torch

from higgs_engine.ct.gptq import activation_order, gptq_layer, gptq_layer_reference
from higgs_engine.ct.quantizer import dequantize, quantize_layer
from higgs_engine.ct.schemes import ct_scheme
from higgs_engine.errors import InvalidConfigError
from higgs_engine.gptq import HessianAccumulator, output_error

SCHEMES = ["w4a16-g32", "w4a16-g64", "w4a16-g128", "w8a16", "fp8-dynamic"]


@pytest.fixture(scope="module")
def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs with strongly correlated, unequal columns (as activations are), a weight, and
    the inputs' Hessian."""
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(256, 256, generator=gen) / 16
    x = torch.randn(2048, 256, generator=gen) @ mix
    x *= torch.linspace(0.2, 3.0, 256)
    w = torch.randn(48, 256, generator=gen)
    acc = HessianAccumulator(256)
    acc.add(x)
    return x, w, acc.hessian()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("name", SCHEMES)
def test_fast_sweep_equals_reference(
    problem: tuple[torch.Tensor, torch.Tensor, torch.Tensor], name: str, act_order: bool
) -> None:
    _, w, h = problem
    scheme = ct_scheme(name)
    # block 32: several lazy batches, batch boundaries inside the g64 / g128 groups
    fast = gptq_layer(w, h, scheme, block=32, precision=torch.float64, act_order=act_order)
    ref = gptq_layer_reference(w, h, scheme, act_order=act_order)
    same = (fast.codes.to(torch.float32) == ref.codes.to(torch.float32)).float().mean().item()
    assert same > 0.999, same
    assert (fast.scale == ref.scale).float().mean().item() > 0.999
    # float32, the production precision, lands on nearly the same codes
    f32 = gptq_layer(w, h, scheme, act_order=act_order)
    assert (f32.codes.to(torch.float32) == ref.codes.to(torch.float32)).float().mean() > 0.97
    assert f32.codes.dtype == quantize_layer(w, scheme).codes.dtype
    assert f32.scale.shape == quantize_layer(w, scheme).scale.shape


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("name", SCHEMES)
def test_identity_hessian_gives_the_data_free_layer(name: str, act_order: bool) -> None:
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(4))
    scheme = ct_scheme(name)
    q = gptq_layer(w, torch.eye(256), scheme, damp=0.0, act_order=act_order)
    free = quantize_layer(w, scheme)
    assert torch.equal(q.scale, free.scale)
    assert torch.equal(q.codes.to(torch.float32), free.codes.to(torch.float32))


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("name", ["w4a16-g32", "w4a16-g128", "w8a16"])
def test_correlated_inputs_get_a_lower_output_error(
    problem: tuple[torch.Tensor, torch.Tensor, torch.Tensor], name: str, act_order: bool
) -> None:
    x, w, h = problem
    scheme = ct_scheme(name)
    calibrated = output_error(x, w, dequantize(gptq_layer(w, h, scheme, act_order=act_order)))
    free = output_error(x, w, dequantize(quantize_layer(w, scheme)))
    assert calibrated < 0.8 * free, (calibrated, free)


def test_activation_order_sweeps_the_loudest_inputs_first_with_the_data_free_scales(
    problem: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    _, w, h = problem
    order = activation_order(h)
    diag = torch.diagonal(h)[order]
    assert bool((diag[:-1] >= diag[1:]).all()) and sorted(order.tolist()) == list(range(256))
    ties = torch.ones(8, dtype=torch.float64)
    assert activation_order(torch.diag(ties)).tolist() == list(range(8))  # ties: layer order
    # a group's columns are no longer swept together: every scale is fixed first, data-free
    scheme = ct_scheme("w4a16-g64")
    assert torch.equal(
        gptq_layer(w, h, scheme, act_order=True).scale, quantize_layer(w, scheme).scale
    )


@pytest.mark.parametrize("name", ["w4a16-g64", "w8a16", "fp8-dynamic"])
def test_the_library_decompresses_a_calibrated_layer_exactly(
    problem: tuple[torch.Tensor, torch.Tensor, torch.Tensor], name: str
) -> None:
    from compressed_tensors.compressors import BaseCompressor

    from higgs_engine.ct.writer import compress_layer, library_scheme

    _, w, h = problem
    scheme = ct_scheme(name)
    q = gptq_layer(w, h, scheme, torch.bfloat16)
    stored = compress_layer(q, torch.bfloat16)
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    back = compressor.decompress(dict(stored), library_scheme(scheme, ["Linear"]))
    assert back["weight"].dtype == torch.bfloat16
    assert torch.equal(back["weight"], dequantize(q))


def test_refusals_name_the_problem(
    problem: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    _, w, h = problem
    with pytest.raises(InvalidConfigError, match="symmetric"):
        gptq_layer(w, h, ct_scheme("w4a16-asym-g128"))
    with pytest.raises(InvalidConfigError, match=r"Hessian of shape \(8, 8\)"):
        gptq_layer(w, torch.eye(8), ct_scheme("w4a16-g128"))
    with pytest.raises(InvalidConfigError, match="must nest"):
        gptq_layer(w, h, ct_scheme("w4a16-g128"), block=96)
    with pytest.raises(InvalidConfigError, match="not quantized"):
        gptq_layer(w, h, ct_scheme("keep"))
