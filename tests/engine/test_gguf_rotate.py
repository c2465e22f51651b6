"""Residual rotation before GGUF conversion: the rotated model is the same function (float64),
it converts and runs in llama.cpp, and the GGUF run chooses it only where asked / predicted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from higgs_engine.errors import InvalidConfigError, UnsupportedModelError
from higgs_engine.gguf.rotate import (
    haar_orthogonal,
    head_rotation,
    residual_rotation,
    rotate_state_dict,
    rotation_error,
    untied_config,
    write_rotated_checkpoint,
)
from tests.fixtures import build_gguf_llama, build_tiny_checkpoint

TOKENS = [1, 17, 200, 45, 99, 3, 250, 8, 64, 300, 12, 13]


@pytest.mark.parametrize("hidden", [64, 96, 576, 7])
def test_rotation_is_orthogonal_and_fast_path_matches(hidden: int) -> None:
    rot = residual_rotation(hidden, seed=3)
    q = rot.matrix()
    assert rotation_error(q) < 1e-12
    x = torch.randn(5, hidden, dtype=torch.float64)
    assert torch.allclose(rot.right(x), x @ q, atol=1e-12)
    w = torch.randn(hidden, 11, dtype=torch.float64)
    assert torch.allclose(rot.left_t(w), q.T @ w, atol=1e-12)
    # dense: every entry about 1/sqrt(hidden) (Hadamard part) or nonzero (orthogonal block)
    assert (q.abs() > 0).float().mean() > 0.99
    if hidden == 576:
        assert rot.kind == "random orthogonal 9 (x) randomized Hadamard 64"
    if hidden == 64:
        assert rot.kind == "randomized Hadamard 64"
        assert torch.allclose(q.abs(), torch.full_like(q, 1 / 8))
    assert torch.equal(residual_rotation(hidden, seed=3).matrix(), q)  # seeded


def test_small_pieces() -> None:
    b = haar_orthogonal(9, 0)
    assert rotation_error(b) < 1e-12
    assert head_rotation(48) is None
    r = head_rotation(16)
    assert r is not None and rotation_error(r) < 1e-12


def _float64_logits(model_dir: Path, state: dict[str, torch.Tensor] | None = None) -> np.ndarray:
    from transformers import AutoConfig, AutoModelForCausalLM

    if state is None:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64)
    else:
        cfg = AutoConfig.from_pretrained(str(model_dir))
        cfg = type(cfg).from_dict(untied_config(cfg.to_dict()))
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    _float64_norms(model)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].numpy()


def _rms_norm_f64(self: Any, x: torch.Tensor) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


def _float64_norms(model: torch.nn.Module) -> None:
    """transformers' RMSNorm normalises in float32 whatever the model's dtype; in float64 the
    comparison is exact to rounding."""
    import types

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(_rms_norm_f64, m)


def _randomize_norms(path: Path) -> None:
    """Norm weights away from 1 (as in trained models) so that folding is tested."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    sd = load_file(str(f))
    g = torch.Generator().manual_seed(7)
    for k, v in sd.items():
        if k.endswith("norm.weight"):
            sd[k] = (0.5 + torch.rand(v.shape, generator=g)).to(v.dtype)
    save_file(sd, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "hidden_size": 96, "num_attention_heads": 6}),
        ("qwen2", {}),  # tied, q/k/v biases
    ],
)
def test_rotated_model_is_the_same_function(
    tmp_path: Path, kind: str, overrides: dict[str, Any]
) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = build_tiny_checkpoint(kind, tmp_path / kind, tokenizer=False, **overrides)
    _randomize_norms(ckpt)
    ref = _float64_logits(ckpt)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float64)
    cfg = model.config.to_dict()
    for heads in (False, True):
        rotated = rotate_state_dict(model.state_dict(), cfg, seed=1, heads=heads)
        assert "lm_head.weight" in rotated
        got = _float64_logits(ckpt, rotated)
        assert np.abs(got - ref).max() <= 1e-9 * np.abs(ref).max()
        # and it did change the weights
        e = "model.embed_tokens.weight"
        assert not torch.allclose(rotated[e], model.state_dict()[e].double())


def test_non_llama_is_refused(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint("gemma2", tmp_path / "g", tokenizer=False)
    with pytest.raises(UnsupportedModelError, match="Gemma2ForCausalLM"):
        write_rotated_checkpoint(ckpt, tmp_path / "out")
    with pytest.raises(InvalidConfigError):
        residual_rotation(0)


# slow: a llama.cpp conversion and run (the lane keeps test_rotate_on_pays_for_the_untied_head)
@pytest.mark.slow
def test_rotated_checkpoint_converts_and_runs_in_llama_cpp(tmp_path: Path) -> None:
    """The written (float32) rotated checkpoint through llama.cpp's converter gives the
    unrotated model's logits in llama.cpp, tied head untied."""
    from higgs_engine.gguf.convert import convert_checkpoint
    from higgs_engine.gguf.llama import LlamaModel
    from higgs_engine.gguf.plan import read_gguf

    ckpt = build_gguf_llama(tmp_path / "tiny", tie_word_embeddings=True)
    _randomize_norms(ckpt)
    rc = write_rotated_checkpoint(ckpt, tmp_path / "rot", seed=0)
    assert rc.plan["untied_head"] and rc.added_params == 320 * 256
    assert (tmp_path / "rot" / "tokenizer.model").is_file() or any(
        p.name.startswith("tokenizer") for p in (tmp_path / "rot").iterdir()
    )
    plain = convert_checkpoint(ckpt, tmp_path / "plain.gguf", outtype="f32")
    rot = convert_checkpoint(rc.path, tmp_path / "rot.gguf", outtype="f32")
    fp, fr = read_gguf(plain), read_gguf(rot)
    assert "output.weight" not in {t.name for t in fp.tensors}
    assert "output.weight" in {t.name for t in fr.tensors}
    assert fr.params_total == fp.params_total + rc.added_params
    with LlamaModel(plain, n_ctx=32) as a, LlamaModel(rot, n_ctx=32) as b:
        ref, got = a.logits(TOKENS), b.logits(TOKENS)
    assert np.abs(got - ref).max() < 2e-3 * np.abs(ref).max()


# ---------------------------------------------------------------------------------------------
# The GGUF run with rotate = on / auto
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = build_gguf_llama(tmp_path_factory.mktemp("rot") / "tied", tie_word_embeddings=True)
    _randomize_norms(ckpt)
    return ckpt


def test_rotate_on_pays_for_the_untied_head(tied_llama: Path, tmp_path: Path) -> None:
    from higgs_engine.gguf.plan import read_gguf
    from higgs_engine.gguf.runplan import GgufEvalRequest
    from higgs_engine.planning.plans import Target
    from tests.engine.test_gguf import TINY_PROFILE, quantize
    from tests.fixtures import TINY_TEXT

    rep = quantize(
        tied_llama,
        tmp_path / "out",
        target=Target(avg_bits=4.5),
        profile=TINY_PROFILE,
        rotate="on",
        evaluate=GgufEvalRequest(TINY_TEXT * 8, "tiny", context=32, windows=2),
    )
    m = rep.metrics
    assert m["rotated"] and m["rotate"] == "on" and rep.config["rotate"] == "on"
    assert m["rotation"]["untied_head"] and m["rotation"]["added_params"] == 320 * 256
    files = sorted((tmp_path / "out" / "gguf").glob("*.gguf"))
    written = read_gguf(files, quantized=True)
    assert "output.weight" in written.types
    # the budget is the unrotated file's: 4.5 bits over the unrotated parameter count
    assert m["bits_per_unrotated_weight"] <= 4.5 + 1e-9
    assert rep.bits_per_weight < m["bits_per_unrotated_weight"]
    assert m["kl"] >= 0 and m["ppl_quantized"] > 0 and m["predicted_change"] > 0


# slow: two profiles and allocations, rotated and not
@pytest.mark.slow
def test_rotate_auto_keeps_the_lower_prediction(tied_llama: Path, tmp_path: Path) -> None:
    from higgs_engine.planning.plans import Target
    from tests.engine.test_gguf import TINY_PROFILE, quantize

    rep = quantize(
        tied_llama,
        tmp_path / "out",
        target=Target(avg_bits=5.0),
        profile=TINY_PROFILE,
        rotate="auto",
    )
    m = rep.metrics
    r = m["rotation"]
    plain, rot = r["predicted_change_plain"], r["predicted_change_rotated"]
    assert m["rotated"] == (rot < plain)
    assert m["predicted_change"] == pytest.approx(min(plain, rot))
    assert r["tensor_bytes_rotated"] <= 5.0 * r["params_unrotated"] / 8 + 1e-6


def test_rotate_is_refused_or_skipped_outside_the_llama_family(tmp_path: Path) -> None:
    from tests.engine.test_gguf import quantize
    from tests.fixtures import build_tiny_encoder

    bert = build_tiny_encoder(tmp_path / "bert")
    with pytest.raises(InvalidConfigError, match="BertModel") as e:
        quantize(bert, tmp_path / "out", bits=8, rotate="on")
    assert e.value.field == "rotate"
    assert not (tmp_path / "out").exists()
    from higgs_engine.gguf.runplan import GgufRotation

    with pytest.raises(InvalidConfigError, match="rotate='sideways'"):
        GgufRotation("sideways")


# slow: several quantizations and llama.cpp files (a minute)
@pytest.mark.slow
def test_rotate_auto_with_a_bound_keeps_the_smaller_file(tied_llama: Path, tmp_path: Path) -> None:
    from higgs_engine.planning.plans import Target
    from tests.engine.test_gguf import TINY_PROFILE, quantize

    rep = quantize(
        tied_llama,
        tmp_path / "ppl",
        target=Target(max_ppl_increase=0.05),
        profile=TINY_PROFILE,
        rotate="auto",
    )
    r = rep.metrics["rotation"]
    assert rep.metrics["rotated"] == (r["tensor_bytes_rotated"] < r["tensor_bytes_plain"])
    # a budget below the smallest rotated file names the untied head
    from higgs_engine.errors import InfeasibleTargetError

    with pytest.raises(InfeasibleTargetError, match="smallest rotated GGUF file"):
        quantize(
            tied_llama,
            tmp_path / "small",
            target=Target(avg_bits=2.0),
            profile=TINY_PROFILE,
            rotate="on",
        )
    assert not (tmp_path / "small").exists()
    # without a planning target there is nothing to compare: auto stays unrotated
    rep = quantize(tied_llama, tmp_path / "bits", bits=8, rotate="auto")
    assert not rep.metrics["rotated"] and "rotation" not in rep.metrics


def test_written_checkpoint_is_the_in_memory_rotation(tmp_path: Path) -> None:
    """The streamed writer (embedding and head in row chunks) writes the float32 of
    rotate_state_dict, config untied, tokenizer files copied."""
    import json

    from safetensors.torch import load_file

    ckpt = build_tiny_checkpoint("qwen2", tmp_path / "q", tokenizer=True)
    _randomize_norms(ckpt)
    rc = write_rotated_checkpoint(ckpt, tmp_path / "rot", seed=2, row_chunk=100)
    got = load_file(str(rc.path / "model.safetensors"))
    state = load_file(str(ckpt / "model.safetensors"))
    cfg = json.loads((ckpt / "config.json").read_text())
    want = rotate_state_dict(state, cfg, seed=2)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == torch.float32
        # float32 of the same values (a chunked product may round differently in the last bit)
        assert float((got[k].double() - v).abs().max()) <= 1e-6 * float(v.abs().max()), k
    assert json.loads((rc.path / "config.json").read_text())["tie_word_embeddings"] is False
    assert (rc.path / "tokenizer.json").is_file()
    assert rc.added_params == state["model.embed_tokens.weight"].numel()
