"""Artifacts: native vs dequantized logits, bit-exact round trip, HiggsLinear against the
reference dequantization, stock transformers loading, device handling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from higgs_engine.artifacts import find_model_dir, load_model, load_native, save_native
from higgs_engine.errors import CorruptCheckpointError, ModelNotFoundError
from higgs_engine.modules import HiggsLinear
from higgs_engine.pipeline import quantize_checkpoint
from higgs_engine.planning.config import HiggsConfig, MatrixSpec
from higgs_engine.quantize import dequantize_matrix, quantize_matrix, rotated_weight

KINDS = ["llama", "qwen2", "gemma2", "gpt2"]


@pytest.fixture(scope="module")
def quantized32(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Every tiny model quantized with float32 16-bit tensors (so the dequantized checkpoint
    holds W_hat exactly and logits can be compared tightly)."""
    root = tmp_path_factory.mktemp("art32")
    cfg = HiggsConfig(p=2, n=256, dtype="float32")
    for kind in KINDS:
        quantize_checkpoint(tiny_checkpoints[kind], root / kind, cfg)
    return {kind: root / kind for kind in KINDS}


@pytest.fixture(scope="module")
def quantized16(
    llama_ckpt: Path, gpt2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """llama and gpt2 with the default fp16 tensors and random signs."""
    root = tmp_path_factory.mktemp("art16")
    cfg = HiggsConfig(p=2, n=256, sign_seed=7)
    out = {"llama": root / "llama", "gpt2": root / "gpt2"}
    quantize_checkpoint(llama_ckpt, out["llama"], cfg)
    quantize_checkpoint(gpt2_ckpt, out["gpt2"], cfg)
    return out


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", KINDS)
def test_native_logits_match_dequantized(quantized32: dict[str, Path], kind: str) -> None:
    out = quantized32[kind]
    native, _ = load_model(out / "native", dtype=torch.float32)
    # the dequantized checkpoint through stock transformers, nothing of ours
    deq = AutoModelForCausalLM.from_pretrained(str(out / "dequantized"), dtype=torch.float32).eval()
    assert sum(isinstance(m, HiggsLinear) for m in native.modules()) == (
        8 if kind == "gpt2" else 14
    )
    assert not any(isinstance(m, HiggsLinear) for m in deq.modules())
    with torch.no_grad():
        a = native(_ids()).logits
        b = deq(_ids()).logits
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= 1e-4 * max(1.0, scale)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_native_fp16_artifact_close_to_dequantized(quantized16: dict[str, Path], kind: str) -> None:
    out = quantized16[kind]
    native, _ = load_model(out, dtype=torch.float32)  # the output dir resolves to native/
    deq, _ = load_model(out / "dequantized", dtype=torch.float32)
    with torch.no_grad():
        a = native(_ids()).logits
        b = deq(_ids()).logits
    # dequantized weights were rounded to fp16: agreement to fp16 precision
    assert (a - b).abs().max().item() <= 5e-3 * max(1.0, b.abs().max().item())


def test_round_trip_is_bit_exact(quantized16: dict[str, Path], tmp_path: Path) -> None:
    for kind, out in quantized16.items():
        model = load_native(out / "native")
        again = save_native(model, tmp_path / kind)
        for name in ("model.safetensors", "config.json", "tokenizer.json"):
            assert (again / name).read_bytes() == (out / "native" / name).read_bytes(), (kind, name)
        # and the loaded modules hold exactly the stored tensors
        with safe_open(str(out / "native" / "model.safetensors"), framework="pt") as f:
            for name, mod in model.named_modules():
                if isinstance(mod, HiggsLinear):
                    for tname, t in mod.quantized.to_tensors().items():
                        assert torch.equal(t, f.get_tensor(f"{name}.higgs.{tname}"))
    # also after a float32 load (16-bit tensors are cast back on save)
    model32 = load_native(quantized16["llama"] / "native", dtype=torch.float32)
    again = save_native(model32, tmp_path / "llama32")
    assert (again / "model.safetensors").read_bytes() == (
        quantized16["llama"] / "native" / "model.safetensors"
    ).read_bytes()


def test_native_config_carries_quantization_config(quantized16: dict[str, Path]) -> None:
    cfg = json.loads((quantized16["gpt2"] / "native" / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "higgs" and qc["dtype"] == "float16"
    assert qc["grids"] == {"p2n256": "higgs.grid.p2.n256"}
    layer = qc["layers"]["transformer.h.0.attn.c_attn"]
    assert layer["transposed"] is True and layer["p"] == 2 and layer["n"] == 256
    assert layer["layout"] == [64] and layer["sign_seed"] == 7
    assert layer["bias_key"] == "transformer.h.0.attn.c_attn.bias"
    deq_cfg = json.loads((quantized16["gpt2"] / "dequantized" / "config.json").read_text())
    assert "quantization_config" not in deq_cfg and deq_cfg["dtype"] == "float16"


def test_higgs_linear_matches_reference() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=g)
    b = torch.randn(40, generator=g)
    for p, n, seed in ((2, 256, None), (1, 16, 5), (2, 64, 1)):
        q = quantize_matrix(w, MatrixSpec(p, n, group_size=64, sign_seed=seed))
        lin = HiggsLinear(q, b)
        assert torch.equal(lin.rotated_weight(), rotated_weight(q))
        x = torch.randn(3, 5, 96, generator=g)
        ref = x.double() @ dequantize_matrix(q).double().T + b.double()
        assert torch.allclose(lin(x).double(), ref, atol=1e-4, rtol=1e-4)
        assert lin(x.half()).dtype == torch.float16
        assert torch.equal(lin.dequantized_weight(), dequantize_matrix(q))


def test_higgs_linear_keeps_its_dtypes_under_model_casts() -> None:
    q = quantize_matrix(torch.randn(16, 64), MatrixSpec(2, 256))
    lin = HiggsLinear(q, torch.zeros(16))
    lin.to(torch.bfloat16)
    assert lin.scales.dtype == torch.float16 and lin.grid.dtype == torch.float32
    assert (
        lin.codes.dtype == torch.uint8 and lin.bias is not None and lin.bias.dtype == torch.bfloat16
    )
    assert torch.equal(lin.scales, q.scales)
    assert set(lin.state_dict()) == {"codes", "scales", "bias"}


def test_load_model_errors(tmp_path: Path, quantized16: dict[str, Path]) -> None:
    with pytest.raises(ModelNotFoundError):
        find_model_dir(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(quantized16["llama"] / "native", bad)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.higgs.codes"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CorruptCheckpointError):
        load_model(bad)


@pytest.mark.gpu
def test_native_model_runs_on_cuda(quantized32: dict[str, Path]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    for kind in KINDS:
        cpu, _ = load_model(quantized32[kind] / "native", dtype=torch.float32)
        gpu, _ = load_model(quantized32[kind] / "native", device="cuda", dtype=torch.float32)
        lin = next(m for m in gpu.modules() if isinstance(m, HiggsLinear))
        assert lin.codes.is_cuda and lin.scales.dtype == torch.float16
        with torch.no_grad():
            a = cpu(_ids()).logits
            b = gpu(_ids().cuda()).logits.cpu()
        assert (a - b).abs().max().item() <= 1e-3 * max(1.0, a.abs().max().item())
        half, _ = load_model(quantized32[kind] / "native", device="cuda", dtype=torch.float16)
        with torch.no_grad():
            c = half(_ids().cuda()).logits.float().cpu()
        assert torch.isfinite(c).all()


def test_params_on_meta_affects_only_the_loading_thread() -> None:
    """Building a model to load (parameters on meta) never changes modules other threads
    construct meanwhile."""
    import threading

    from higgs_engine.model_loading import params_on_meta

    inside = threading.Event()
    release = threading.Event()
    seen: dict[str, str] = {}

    def loader() -> None:
        with params_on_meta():
            seen["loader"] = torch.nn.Linear(4, 4).weight.device.type
            inside.set()
            release.wait(10)

    t = threading.Thread(target=loader)
    t.start()
    assert inside.wait(10)
    seen["other"] = torch.nn.Linear(4, 4).weight.device.type  # while the loader is inside
    release.set()
    t.join(10)
    seen["after"] = torch.nn.Linear(4, 4).weight.device.type
    assert seen == {"loader": "meta", "other": "cpu", "after": "cpu"}
