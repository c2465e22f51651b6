"""A checkpoint's config checked against its tensors (higgs_engine.checkpoint_check): every
healthy checkpoint passes, every lie of the hostile corpus fails as corrupt_checkpoint naming
its field before anything is built, and the finite check names the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from higgs_engine.checkpoint_check import (
    MAX_POSITIONS,
    Declared,
    check_declared,
    check_finite,
    check_tokenizer,
)
from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError, UnsupportedModelError
from higgs_engine.model_structure import load_config
from tests.fixtures import build_tiny_encoder
from tests.hostile_corpus import HOSTILE, build_case

REAL = Path(__file__).resolve().parents[2] / "data"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "gpt2", "llama_sharded"])
def test_healthy_tiny_checkpoints_pass(tiny_checkpoints: dict[str, Path], kind: str) -> None:
    load_config(tiny_checkpoints[kind])


def test_healthy_encoder_passes(tmp_path: Path) -> None:
    load_config(build_tiny_encoder(tmp_path / "enc"))


@pytest.mark.realdata
@pytest.mark.parametrize("name", ["smollm2-135m", "minilm"])
def test_real_checkpoints_pass(name: str) -> None:
    if not (REAL / name / "config.json").is_file():
        pytest.skip(f"data/{name} is not prepared")
    load_config(REAL / name)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    for case in HOSTILE:
        build_case(case, root / case)
    return root


@pytest.mark.parametrize(
    "case",
    sorted(c for c, (_, code, _) in HOSTILE.items() if code == "corrupt_checkpoint"),
)
def test_lies_fail_at_the_config(corpus: Path, case: str) -> None:
    _, _, text = HOSTILE[case]
    with pytest.raises(CorruptCheckpointError, match=text.replace(".", r"\.")) as exc:
        load_config(corpus / case)
    if text.endswith(("_size", "_layers", "_heads")):
        assert exc.value.field == text


def test_unknown_architecture_is_unsupported(corpus: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="hostile"):
        load_config(corpus / "unknown-architecture")


@pytest.mark.parametrize("case", ["nan-weights", "inf-embedding"])
def test_finite_check_names_the_tensor(corpus: Path, case: str) -> None:
    load_config(corpus / case)  # the config itself is fine
    tensor = "down_proj" if case == "nan-weights" else "model.embed_tokens.weight"
    with pytest.raises(InvalidConfigError, match=f"{tensor}.*non-finite"):
        check_finite(corpus / case)


def test_sharded_index_without_its_shards_checks_the_names(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A fanned-out Hub model has only its index at first: the layer count is checked from
    the names the index lists, the shapes from the shards at hand."""
    src = tiny_checkpoints["llama_sharded"]
    dst = tmp_path / "index-only"
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    load_config(dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_hidden_layers"] = 7
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptCheckpointError, match="num_hidden_layers=7"):
        load_config(dst)


LLAMA_SHAPES = {
    "model.embed_tokens.weight": (320, 64),
    "lm_head.weight": (320, 64),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.self_attn.k_proj.weight": (32, 64),
    "model.layers.0.mlp.up_proj.weight": (96, 64),
    "model.layers.1.mlp.up_proj.weight": (96, 64),
}
LLAMA = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vocab_size", 321),
        ("vocab_size", 0),
        ("vocab_size", True),
        ("vocab_size", 64.0),
        ("hidden_size", 128),
        ("intermediate_size", 1 << 24),
        ("num_hidden_layers", 3),
        ("num_attention_heads", 128),
        ("num_attention_heads", 5),
        ("num_key_value_heads", 4),
        ("head_dim", 32),
        ("max_position_embeddings", MAX_POSITIONS + 1),
    ],
)
def test_each_sizing_field_is_checked(field: str, value: object) -> None:
    check_declared(Declared(LLAMA), LLAMA_SHAPES, sorted(LLAMA_SHAPES))
    with pytest.raises(CorruptCheckpointError, match=field) as exc:
        check_declared(Declared({**LLAMA, field: value}), LLAMA_SHAPES, sorted(LLAMA_SHAPES))
    assert exc.value.field == field


def test_a_missing_middle_layer_is_named() -> None:
    shapes = {k.replace("layers.1.", "layers.2."): v for k, v in LLAMA_SHAPES.items()}
    with pytest.raises(CorruptCheckpointError, match=r"layers \[1\]"):
        check_declared(Declared({**LLAMA, "num_hidden_layers": 3}), shapes, sorted(shapes))


def test_tokenizer_ids_beyond_the_vocabulary() -> None:
    ok = {"model": {"vocab": {"a": 0, "b": 319}}, "added_tokens": [{"id": 1}]}
    check_tokenizer(json.dumps(ok).encode(), 320)
    bad = {"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 320}]}
    with pytest.raises(CorruptCheckpointError, match="token id 320"):
        check_tokenizer(json.dumps(bad).encode(), 320)
    with pytest.raises(CorruptCheckpointError, match=r"tokenizer\.json"):
        check_tokenizer(b"[not json", 320)
