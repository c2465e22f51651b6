"""The block-by-block calibration pass and calibrated HIGGS through quantize_checkpoint, on the
tiny Llama / Qwen2 / Gemma2 / GPT-2 checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from higgs_engine.artifacts import load_model
from higgs_engine.calibration import (
    MAX_CALIBRATION_BYTES,
    Calibration,
    calibration_from_text,
    check_calibration_text,
    read_calibration_file,
    run_calibrated,
)
from higgs_engine.errors import CancelledError, InvalidConfigError
from higgs_engine.gptq import HessianAccumulator
from higgs_engine.model_structure import LayerSpec, layer_specs, load_config
from higgs_engine.pipeline import quantize_checkpoint
from higgs_engine.planning.config import HiggsConfig, LayerOverride
from higgs_engine.quantize import dequantize_matrix
from higgs_engine.safetensors_stream import CheckpointReader
from higgs_engine.sources import resolve_model

KINDS = ["llama", "qwen2", "gemma2", "gpt2"]


def _windows(count: int = 3, context: int = 48, seed: int = 0) -> torch.Tensor:
    # Context 48 is longer than the tiny Gemma2's sliding window (32): its masks differ per block.
    return torch.randint(0, 300, (count, context), generator=torch.Generator().manual_seed(seed))


def _float_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", KINDS)
def test_pass_with_float_weights_sees_the_models_own_inputs(
    kind: str, tiny_checkpoints: dict[str, Path]
) -> None:
    """A quantizer that returns W unchanged: every Hessian must equal the one computed from a
    full float forward of the same windows (block inputs, kwargs and masks all right)."""
    path = tiny_checkpoints[kind]
    cfg = load_config(path)
    windows = _windows()
    got: dict[str, torch.Tensor] = {}
    calls: list[list[str]] = []

    def identity(
        group: list[LayerSpec], ws: list[torch.Tensor], h: torch.Tensor
    ) -> list[torch.Tensor]:
        calls.append([s.name for s in group])
        for s in group:
            got[s.name] = h
        return ws

    with CheckpointReader(path) as reader:
        specs = layer_specs(cfg, reader.keys())
        outside = run_calibrated(
            resolve_model(path), reader, specs, Calibration(windows, "x", "t"), identity
        )
    assert outside == [] and set(got) == {s.name for s in specs}
    model = _float_model(path)
    mods = dict(model.named_modules())
    accs = {s.name: HessianAccumulator(s.in_features) for s in specs}
    for s in specs:
        mods[s.name].register_forward_hook(lambda m, a, o, n=s.name: accs[n].add(a[0]))
    with torch.no_grad():
        for i in range(windows.shape[0]):
            model(input_ids=windows[i : i + 1])
    for name, acc in accs.items():
        torch.testing.assert_close(got[name], acc.hessian(), rtol=1e-4, atol=1e-6)
    # Layers that read one input come together (q/k/v; gate/up on the gated MLPs).
    if kind != "gpt2":
        assert [len(c) for c in calls[:4]] == [3, 1, 2, 1]


def test_pass_skips_work_that_feeds_no_hessian(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hessian pass stops each window after the block's last linear input is recorded
    (after the first window), and the last block is not re-run: the down projections run
    once per block in the Hessian pass and once per window in the re-runs of all blocks but
    the last. (The Hessians themselves are checked by the test above.)"""
    cfg = load_config(llama_ckpt)
    windows = _windows(count=4)
    blocks = int(cfg.num_hidden_layers)
    down_calls: list[int] = []
    forward = torch.nn.Linear.forward

    def counting(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self.in_features == int(cfg.intermediate_size):
            down_calls.append(1)
        return forward(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", counting)
    with CheckpointReader(llama_ckpt) as reader:
        specs = layer_specs(cfg, reader.keys())
        run_calibrated(
            resolve_model(llama_ckpt),
            reader,
            specs,
            Calibration(windows, "x", "t"),
            lambda g, ws, h: ws,
        )
    assert blocks >= 2
    assert len(down_calls) == blocks + (blocks - 1) * windows.shape[0]


def test_later_blocks_see_the_quantized_outputs(llama_ckpt: Path) -> None:
    """Block 1's Hessians come from block 0 run with ITS quantized weights."""
    cfg = load_config(llama_ckpt)
    windows = _windows()
    seen: dict[str, torch.Tensor] = {}

    def zero_block0(
        group: list[LayerSpec], ws: list[torch.Tensor], h: torch.Tensor
    ) -> list[torch.Tensor]:
        for s in group:
            seen[s.name] = h
        return [
            torch.zeros_like(w) if ".layers.0." in s.name else w
            for s, w in zip(group, ws, strict=True)
        ]

    with CheckpointReader(llama_ckpt) as reader:
        specs = layer_specs(cfg, reader.keys())
        run_calibrated(
            resolve_model(llama_ckpt), reader, specs, Calibration(windows, "x", "t"), zero_block0
        )
    # With block 0's linears zeroed, block 0 is the identity (residual only): block 1's input
    # is the embedding, whose Hessian after the input norm we recompute here.
    model: Any = _float_model(llama_ckpt)  # a transformers causal LM
    acc = HessianAccumulator(64)
    blk = model.model.layers[1]
    with torch.no_grad():
        for i in range(windows.shape[0]):
            acc.add(blk.input_layernorm(model.model.embed_tokens(windows[i : i + 1])))
    torch.testing.assert_close(
        seen["model.layers.1.self_attn.q_proj"], acc.hessian(), rtol=1e-4, atol=1e-6
    )


@pytest.fixture(scope="module")
def tiny_text(tiny_text_file: Path) -> str:
    return tiny_text_file.read_text() * 20


@pytest.mark.parametrize("kind", KINDS)
def test_calibrated_quantize_checkpoint(
    kind: str, tiny_checkpoints: dict[str, Path], tmp_path: Path, tiny_text: str
) -> None:
    from transformers import AutoTokenizer

    path = tiny_checkpoints[kind]
    tok = AutoTokenizer.from_pretrained(str(path))
    cal = calibration_from_text(tiny_text, tok, tokens=256, context=64, source="file")
    cfg = HiggsConfig(p=2, n=64, group_size=64, rotation_block=64)
    stages: list[tuple[str, int, int]] = []
    rep = quantize_checkpoint(
        path, tmp_path / "cal", cfg, lambda s, d, t: stages.append((s, d, t)), calibration=cal
    )
    free = quantize_checkpoint(path, tmp_path / "free", cfg)
    info = rep.metrics["calibration"]
    assert info["sha256"] == cal.sha256 and info["tokens"] == 256 and info["source"] == "file"
    assert info["layers_calibrated"] == len(rep.layers) and info["layers_without_data"] == []
    cal_stages = [x for x in stages if x[0] == "calibrating"]
    assert cal_stages[0][1] == 0 and cal_stages[-1][1] == cal_stages[-1][2] == len(rep.layers)
    # Same format and bit accounting as data-free HIGGS; only codes and scales differ.
    assert rep.bits_per_weight == free.bits_per_weight
    assert rep.bytes_after == free.bytes_after
    assert [r.rel_error for r in rep.layers] != [r.rel_error for r in free.layers]
    # The native artifact loads with the ordinary loader and computes what the dequantized
    # artifact holds; calibration lowers the output error on the calibration windows.
    native, _ = load_model(tmp_path / "cal" / "native", dtype=torch.float32)
    deq, _ = load_model(tmp_path / "cal" / "dequantized", dtype=torch.float32)
    base = _float_model(path)
    free_m, _ = load_model(tmp_path / "free" / "dequantized", dtype=torch.float32)
    x = cal.windows[:2]
    with torch.no_grad():
        ref = base(input_ids=x).logits
        out_n = native(input_ids=x).logits
        out_d = deq(input_ids=x).logits
        out_f = free_m(input_ids=x).logits
    # They differ only by the float16 rounding of the dequantized weights.
    assert float((out_n - out_d).norm() / out_d.norm()) < 1e-2
    assert (out_d - ref).square().mean() < (out_f - ref).square().mean()


def test_calibrated_with_overrides_and_rel_error(
    llama_ckpt: Path, tmp_path: Path, tiny_text: str
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_ckpt))
    cal = calibration_from_text(tiny_text, tok, tokens=128, context=64)
    cfg = HiggsConfig(
        p=2,
        n=256,
        group_size=64,
        rotation_block=64,
        overrides=(
            LayerOverride("model.layers.0.self_attn.k_proj", 1, 16),
            LayerOverride("model.layers.1.mlp.down_proj", 0, 0),
        ),
    )
    rep = quantize_checkpoint(llama_ckpt, tmp_path / "o", cfg, calibration=cal)
    by = {r.name: r for r in rep.layers}
    assert (by["model.layers.0.self_attn.k_proj"].p, by["model.layers.0.self_attn.k_proj"].n) == (
        1,
        16,
    )
    assert by["model.layers.1.mlp.down_proj"].p == 0
    assert rep.metrics["calibration"]["layers_calibrated"] == len(rep.layers) - 1
    model, _ = load_model(tmp_path / "o" / "native", dtype=torch.float32)
    q_layer = dict(model.named_modules())["model.layers.0.self_attn.q_proj"]
    with CheckpointReader(llama_ckpt) as reader:
        w0 = reader.get("model.layers.0.self_attn.q_proj.weight").float()
    w_hat = dequantize_matrix(q_layer.quantized)
    t2 = float((w_hat - w0).square().sum() / w0.square().sum())
    assert by["model.layers.0.self_attn.q_proj"].rel_error == pytest.approx(t2, rel=1e-4)


def test_cancel_during_calibration_leaves_nothing(llama_ckpt: Path, tmp_path: Path) -> None:
    cal = Calibration(_windows(), "x", "t")

    def cancel(stage: str, done: int, total: int) -> bool:
        return not (stage == "calibrating" and done >= 3)

    with pytest.raises(CancelledError):
        quantize_checkpoint(llama_ckpt, tmp_path / "c", HiggsConfig(), cancel, calibration=cal)
    assert list(tmp_path.iterdir()) == []


def test_calibration_text_checks(tmp_path: Path, llama_ckpt: Path) -> None:
    from transformers import AutoTokenizer

    with pytest.raises(InvalidConfigError, match="empty"):
        check_calibration_text(b"  \n\t ")
    with pytest.raises(InvalidConfigError, match="NUL"):
        check_calibration_text(b"abc\x00def")
    with pytest.raises(InvalidConfigError, match="UTF-8"):
        check_calibration_text(b"\xff\xfe\x00a")
    with pytest.raises(InvalidConfigError, match="byte limit"):
        check_calibration_text(b"a" * (MAX_CALIBRATION_BYTES + 1))
    big = tmp_path / "big.txt"
    with big.open("wb") as f:
        f.truncate(MAX_CALIBRATION_BYTES + 1)
    with pytest.raises(InvalidConfigError, match="byte limit"):
        read_calibration_file(big)
    with pytest.raises(InvalidConfigError, match="does not exist"):
        read_calibration_file(tmp_path / "missing.txt")
    tok = AutoTokenizer.from_pretrained(str(llama_ckpt))
    with pytest.raises(InvalidConfigError, match="fewer than the 100000 requested"):
        calibration_from_text("a few words only", tok, tokens=100000)
    cal = calibration_from_text("the council met on monday " * 200, tok, tokens=300, context=128)
    assert cal.windows.shape == (2, 128) and cal.tokens == 256
