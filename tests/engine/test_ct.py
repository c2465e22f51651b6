"""The compressed-tensors engine core (higgs_engine/ct): the scheme menu, the MSE scale search
against its reference twin and against the library's min-max, the library's own compressors and
decompression bit-exact to our dequantization, transformers loading the written directory with
logits equal to our dequantized model's, and the allocator over the menu."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from higgs_engine.ct.plan import (
    allocate_schemes,
    fusion_units,
    measure_options,
    predicted_change,
)
from higgs_engine.ct.quantizer import (
    MULTIPLIERS,
    dequantize,
    fp8_per_token,
    quantize_layer,
    quantize_layer_reference,
    relative_error,
)
from higgs_engine.ct.schemes import (
    ASYMMETRIC,
    CT_MENU,
    KEEP,
    CtScheme,
    ct_scheme,
    scheme_menu,
    uniform_scheme,
)
from higgs_engine.ct.writer import (
    CtAssignment,
    compress_layer,
    ct_layers,
    uniform_assignment,
    write_compressed_tensors,
)
from higgs_engine.errors import InfeasibleTargetError, InvalidConfigError
from higgs_engine.planning.profile import Profile
from tests.fixtures import build_tiny_checkpoint, build_tiny_encoder, measure_tiny_profile

QUANTIZED = [s for s in CT_MENU if not s.keep]


def _heavy(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Weights with real checkpoints' heavy tails: a Gaussian plus a few large values."""
    g = torch.Generator().manual_seed(seed)
    return (
        0.02 * torch.randn(rows, cols, generator=g)
        + 0.01 * torch.randn(rows, cols, generator=g) ** 3
    )


# ------------------------------------------------------------------------------ the menu


def test_smollm2_widths_take_the_groups_vllm_runs() -> None:
    # SmolLM2-135M: hidden 576 (= 9 * 64), intermediate 1536 (= 12 * 128).
    allowed, refused = scheme_menu(1536, 576)
    names = [s.name for s in allowed]
    assert names == ["keep", "w4a16-g32", "w4a16-g64", "w8a16", "fp8-dynamic"]
    assert "576" in refused["w4a16-g128"] and "128" in refused["w4a16-g128"]
    assert uniform_scheme(4, 1536, 576) == (ct_scheme("w4a16-g64"), None)
    assert uniform_scheme(4, 576, 1536) == (ct_scheme("w4a16-g128"), None)
    assert uniform_scheme(4, 64, 96) == (ct_scheme("w4a16-g32"), None)
    assert uniform_scheme(8, 64, 96) == (ct_scheme("w8a16"), None)


def test_a_shape_no_kernel_takes_stays_16_bit_with_a_reason() -> None:
    scheme, why = uniform_scheme(4, 100, 70)
    assert scheme is KEEP and why is not None and "in_features=70" in why
    allowed, refused = scheme_menu(100, 70)
    assert [s.name for s in allowed] == ["keep", "w8a16"]
    assert "multiples of 16" in refused["fp8-dynamic"]
    with pytest.raises(InvalidConfigError, match="bits=3"):
        uniform_scheme(3, 64, 64)
    with pytest.raises(InvalidConfigError, match="'w3'"):
        ct_scheme("w3")


@pytest.mark.parametrize("scheme", [*QUANTIZED, *ASYMMETRIC], ids=lambda s: s.name)
def test_bits_count_every_tensor_the_library_stores(scheme: CtScheme) -> None:
    w = _heavy(48, 128)
    stored = compress_layer(quantize_layer(w, scheme), torch.float16)
    stored_bits = sum(8 * t.numel() * t.element_size() for t in stored.values())
    assert scheme.layer_bits(48, 128) == stored_bits
    expected = {"weight_packed", "weight_scale", "weight_shape"}
    if scheme.weight_type == "float":
        expected = {"weight", "weight_scale"}
    elif not scheme.symmetric:
        expected |= {"weight_zero_point"}
    assert set(stored) == expected


# ------------------------------------------------------------------------------ the quantizer


@pytest.mark.parametrize("scheme", [*QUANTIZED, *ASYMMETRIC], ids=lambda s: s.name)
def test_fast_scale_search_chooses_what_the_reference_chooses(scheme: CtScheme) -> None:
    w = _heavy(32, 128, seed=3)
    fast = quantize_layer(w, scheme)
    ref = quantize_layer_reference(w, scheme)
    # the fast path scores float32 q * s, the reference the stored float16 product in float64:
    # they may part on a near tie, where either scale is as good as the other
    same = (fast.scale == ref.scale).double().mean().item()
    assert same >= 0.9, f"{scheme.name}: only {same:.0%} of the scales agree"
    assert relative_error(w, dequantize(fast)) <= relative_error(w, dequantize(ref)) * (1 + 1e-4)


@pytest.mark.parametrize("scheme", QUANTIZED, ids=lambda s: s.name)
def test_mse_scales_beat_the_librarys_min_max(scheme: CtScheme) -> None:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from higgs_engine.ct.writer import library_scheme

    w = _heavy(64, 256, seed=5)
    args = library_scheme(scheme, ["Linear"]).weights
    wg = w.reshape(64, scheme.groups(256), -1)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    minmax = fake_quantize(w, scale.to(torch.float16), zp, args).to(torch.float32)
    ours = dequantize(quantize_layer(w, scheme)).to(torch.float32)
    assert MULTIPLIERS[-1] == 1.0  # min-max is one of the candidates: never worse
    assert relative_error(w, ours) <= relative_error(w, minmax)
    if scheme.num_bits == 4:  # at 4 bits clipping the tails pays clearly
        assert relative_error(w, ours) < 0.9 * relative_error(w, minmax)


def test_bad_weights_are_refused_by_name() -> None:
    with pytest.raises(InvalidConfigError, match="NaN"):
        quantize_layer(torch.full((4, 64), float("nan")), ct_scheme("w4a16-g32"))
    with pytest.raises(InvalidConfigError, match="group size 64"):
        quantize_layer(torch.ones(4, 96), ct_scheme("w4a16-g64"))
    with pytest.raises(InvalidConfigError, match="keep"):
        quantize_layer(torch.ones(4, 64), KEEP)


# ------------------------------------------------------------------------------ the library's checks


@pytest.mark.parametrize("scheme", [*QUANTIZED, *ASYMMETRIC], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_library_decompression_is_bit_exact_to_ours(scheme: CtScheme, dtype: torch.dtype) -> None:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from higgs_engine.ct.writer import library_scheme

    w = _heavy(40, 256, seed=7)
    w[3] = 0.0  # an all-zero row: every group of it codes exactly
    q = quantize_layer(w, scheme, dtype)
    stored = compress_layer(q, dtype)
    lib = library_scheme(scheme, ["Linear"])
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    back = compressor.decompress(dict(stored), lib)
    ours = dequantize(q)
    assert back["weight"].dtype == ours.dtype == dtype
    assert torch.equal(back["weight"], ours)
    assert torch.equal(ours[3], torch.zeros_like(ours[3]))
    if scheme.weight_type == "int":  # the packed codes are ours
        codes = unpack_from_int32(stored["weight_packed"], scheme.num_bits, torch.Size(w.shape))
        assert torch.equal(codes.to(torch.int8), q.codes)
    else:
        assert torch.equal(stored["weight"].view(torch.uint8), q.codes.view(torch.uint8))


# ------------------------------------------------------------------------------ the checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct_tiny")
    return {k: build_tiny_checkpoint(k, root / k) for k in ("llama", "qwen2", "gemma2")}


def _mixed(source: Path) -> CtAssignment:
    """Every menu scheme somewhere, one scheme per fused unit (as vLLM needs)."""
    specs = ct_layers(source)
    schemes = {}
    for k, unit in enumerate(fusion_units([s.name for s in specs])):
        for i in unit:
            s = CT_MENU[(k + 1) % len(CT_MENU)]
            if s.unfit_reason(specs[i].out_features, specs[i].in_features) is not None:
                s = ct_scheme("w8a16")
            schemes[specs[i].name] = s
    return CtAssignment(schemes)


def reference_model(
    source: Path, assignment: CtAssignment, dtype: torch.dtype, auto: Any = None
) -> Any:
    """Our dequantized model: the source in `dtype`, each quantized layer's weight our
    dequantization of our codes (quantized here again, independently of the writer)."""
    from transformers import AutoModelForCausalLM

    from higgs_engine.safetensors_stream import CheckpointReader

    model = (auto or AutoModelForCausalLM).from_pretrained(str(source), dtype=dtype)
    with torch.no_grad(), CheckpointReader(source) as reader:
        for spec in ct_layers(source):
            scheme = assignment.scheme_of(spec.name)
            if not scheme.keep:
                w_hat = dequantize(quantize_layer(spec.weight(reader), scheme, dtype))
                module: Any = model.get_submodule(spec.name)
                module.weight.copy_(w_hat)
                if scheme.fp8_activations:  # W8A8: inputs rounded to FP8 per token
                    module.register_forward_pre_hook(lambda _m, args: (fp8_per_token(args[0]),))
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_transformers_loads_it_and_its_logits_are_ours(
    tiny: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    from transformers import AutoModelForCausalLM

    source = tiny[kind]
    assignment = _mixed(source)
    out = tmp_path / "ct"
    result = write_compressed_tensors(source, assignment, out)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors"
    assert cfg["format"] == result["quantization_format"] == "mixed-precision"
    assert sorted(cfg["ignore"]) == sorted(result["kept"])
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())

    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()  # the config's float16
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loaded(ids[:, :2])  # compressed-tensors decompresses on the first forward
    ref = reference_model(source, assignment, torch.float16)
    # every weight transformers holds is ours, bit for bit
    ours = ref.state_dict()
    theirs = loaded.state_dict()
    for spec in ct_layers(source):
        key = f"{spec.name}.weight"
        assert torch.equal(theirs[key], ours[key]), key
    with torch.no_grad():  # float16 on the CPU, as both models are
        got = loaded(ids).logits.float()
        want = ref(ids).logits.float()
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_an_encoder_loads_through_automodel_with_our_hidden_states(tmp_path: Path) -> None:
    from transformers import AutoModel

    source = build_tiny_encoder(tmp_path / "bert")
    assignment = uniform_assignment(source, 4)
    result = write_compressed_tensors(source, assignment, tmp_path / "o")
    # hidden 64 -> group 64; the two FFN outputs read the 128-wide intermediate -> group 128
    assert result["schemes"] == {"w4a16-g128": 2, "w4a16-g64": 11}
    loaded = AutoModel.from_pretrained(str(tmp_path / "o")).eval()
    ref = reference_model(source, assignment, torch.float16, AutoModel)
    ids = torch.randint(5, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = loaded(input_ids=ids).last_hidden_state.float()
        want = ref(input_ids=ids).last_hidden_state.float()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_uniform_bits_4_report_and_kept_layers(tiny: dict[str, Path], tmp_path: Path) -> None:
    source = tiny["llama"]  # down_proj's 96 inputs take group 32, the rest 64
    result = write_compressed_tensors(source, uniform_assignment(source, 4), tmp_path / "o")
    assert result["schemes"] == {"w4a16-g32": 2, "w4a16-g64": 12}
    assert result["kept"] == {}
    for e in result["layers"]:
        assert 0 < e["t2"] < 0.05
        assert e["bits"] == ct_scheme(e["scheme"]).layer_bits(*e["shape"])
    numel = sum(e["shape"][0] * e["shape"][1] for e in result["layers"])
    assert result["bits_per_weight"] == pytest.approx(
        sum(e["bits"] for e in result["layers"]) / numel
    )
    # group 64 with fp16 scales: 4 + 16/64 bits per weight, plus the two-int64 shape
    assert 4.25 < result["bits_per_weight"] < 4.6


def test_gpt2_conv1d_layers_stay_16_bit_with_a_reason(tmp_path: Path) -> None:
    source = build_tiny_checkpoint("gpt2", tmp_path / "gpt2")
    assignment = uniform_assignment(source, 4)
    assert assignment.schemes == {} and all("Conv1D" in r for r in assignment.reasons.values())
    result = write_compressed_tensors(source, assignment, tmp_path / "o")
    assert set(result["kept"]) == set(assignment.reasons)


def test_bad_output_or_assignment_leaves_nothing(tiny: dict[str, Path], tmp_path: Path) -> None:
    source = tiny["llama"]
    (tmp_path / "taken").mkdir()
    with pytest.raises(InvalidConfigError, match="already exists"):
        write_compressed_tensors(source, CtAssignment({}), tmp_path / "taken")
    bad = CtAssignment({"model.layers.9.mlp.up_proj": ct_scheme("w8a16")})
    with pytest.raises(InvalidConfigError, match=r"layers\.9"):
        write_compressed_tensors(source, bad, tmp_path / "o")
    with pytest.raises(InvalidConfigError, match="group size 128"):
        write_compressed_tensors(
            source,
            CtAssignment({"model.layers.0.mlp.up_proj": ct_scheme("w4a16-g128")}),
            tmp_path / "o",
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


# ------------------------------------------------------------------------------ the allocator


def test_fusion_units_tie_qkv_and_gate_up() -> None:
    names = [
        "m.0.attn.q_proj",
        "m.0.attn.k_proj",
        "m.0.attn.v_proj",
        "m.0.attn.o_proj",
        "m.0.mlp.gate_proj",
        "m.0.mlp.up_proj",
        "m.0.mlp.down_proj",
        "m.1.attn.q_proj",
    ]
    assert fusion_units(names) == [[0, 1, 2], [3], [4, 5], [6], [7]]


@pytest.fixture(scope="module")
def measured(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    source = tiny["llama"]
    profile = Profile.load(measure_tiny_profile(source, tmp_path_factory.mktemp("p") / "p.json"))
    return source, profile, measure_options(source)


def test_measured_bits_and_errors_are_the_writers(measured: Any, tmp_path: Path) -> None:
    source, _, m = measured
    names = m.names
    for j, scheme in enumerate(m.menu):
        if scheme.keep:
            assert np.all(m.t2[:, j] == 0)
            continue
        assignment = CtAssignment(
            {n: scheme for i, n in enumerate(names) if np.isfinite(m.bits[i, j])}
        )
        result = write_compressed_tensors(source, assignment, tmp_path / scheme.name)
        by_name = {e["name"]: e for e in result["layers"]}
        for i, n in enumerate(names):
            if n in assignment.schemes:
                assert by_name[n]["bits"] == m.bits[i, j]
                assert by_name[n]["t2"] == pytest.approx(m.t2[i, j], rel=1e-12)


def test_allocation_honours_the_budget_and_more_never_predicts_worse(
    measured: Any, tmp_path: Path
) -> None:
    source, profile, m = measured
    lo = float(np.nanmin(np.where(np.isfinite(m.bits), m.bits, np.nan), axis=1).sum())
    numel = sum(s.numel for s in m.layers)
    smallest = lo / numel
    budgets = np.linspace(smallest, 16.0, 15)
    preds = []
    for b in budgets:
        alloc = allocate_schemes(m, profile, avg_bits=float(b))
        assert alloc.avg_bits <= b + 1e-9
        preds.append(alloc.predicted)
        assert alloc.predicted == pytest.approx(predicted_change(m, profile, alloc.assignment))
        for unit in fusion_units(m.names):  # one scheme per fused vLLM layer
            assert len({alloc.assignment.scheme_of(m.names[i]) for i in unit}) == 1
    assert all(b <= a + 1e-15 for a, b in itertools.pairwise(preds))
    assert 0.0 <= preds[-1] < 0.05 * preds[0]
    # the written checkpoint has exactly the bits the allocation counted
    alloc = allocate_schemes(m, profile, avg_bits=5.0)
    result = write_compressed_tensors(source, alloc.assignment, tmp_path / "a")
    assert result["bits_per_weight"] == pytest.approx(alloc.avg_bits, rel=1e-12)
    assert result["bits_per_weight"] <= 5.0
    uniform = predicted_change(m, profile, uniform_assignment(source, 4))
    at_uniform_size = allocate_schemes(
        m,
        profile,
        avg_bits=float(
            write_compressed_tensors(source, uniform_assignment(source, 4), tmp_path / "u")[
                "bits_per_weight"
            ]
        ),
    )
    assert at_uniform_size.predicted <= uniform * (1 + 1e-12)
    with pytest.raises(InfeasibleTargetError, match=f"{smallest:.4f}"):
        allocate_schemes(m, profile, avg_bits=smallest - 0.1)
    within = allocate_schemes(m, profile, max_predicted=preds[5])
    assert within.predicted <= preds[5] and within.avg_bits <= budgets[5] + 1e-3
    with pytest.raises(InvalidConfigError, match="exactly one"):
        allocate_schemes(m, profile)
