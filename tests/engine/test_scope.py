"""scope="all": the token embedding (and an untied output head) quantized with the same HIGGS
machinery as the linear layers, in the uniform and the dynamic case, in single and sharded
runs; the native artifact loads into a working model whose logits match the dequantized
one's, and the report counts the embedding at its quantized size."""

from __future__ import annotations

import filecmp
from pathlib import Path
from typing import Any

import pytest
import torch

from higgs_engine.artifacts import load_model, save_native
from higgs_engine.dynamic import allocated_layers
from higgs_engine.errors import InvalidConfigError
from higgs_engine.job import ProfileSource, QuantizeJob, run
from higgs_engine.model_structure import embedding_specs, load_config, scope_specs
from higgs_engine.modules import HiggsEmbedding, HiggsLinear
from higgs_engine.pipeline import quantize_checkpoint
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.planning.options import option_menu
from higgs_engine.planning.plans import Target
from higgs_engine.planning.profile import ProfileConfig, ProfileDirectory
from higgs_engine.quantize import dequantize_matrix
from higgs_engine.report import Report
from higgs_engine.sources import resolve_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 3 code bits (p=2, n=64): a small grid whose nearest-point table builds fast.
BITS = 3.0
IDS = torch.tensor([[5, 17, 17, 250, 3, 99, 0, 42], [1, 2, 3, 4, 5, 6, 7, 8]])


def _logits(path: Path) -> torch.Tensor:
    model, _ = load_model(path)
    with torch.no_grad():
        out: torch.Tensor = model(IDS).logits.float()
    return out


def test_config_scope_is_checked_and_linear_keeps_the_old_shape() -> None:
    assert "scope" not in HiggsConfig().to_dict()
    cfg = HiggsConfig(scope="all")
    assert cfg.to_dict()["scope"] == "all"
    assert HiggsConfig.from_dict(cfg.to_dict()) == cfg
    assert HiggsConfig.from_dict(HiggsConfig().to_dict()).scope == "linear"
    with pytest.raises(InvalidConfigError, match="scope='embeddings'") as e:
        HiggsConfig(scope="embeddings")
    assert e.value.field == "scope"


def test_scope_specs_list_the_embedding_and_an_untied_head(
    llama_ckpt: Path, qwen2_ckpt: Path
) -> None:
    untied = scope_specs(load_config(llama_ckpt), None, "all")
    assert [(s.name, s.role) for s in untied if s.role != "linear"] == [
        ("model.embed_tokens", "embedding"),
        ("lm_head", "head"),
    ]
    assert untied[0].role == "embedding" and untied[-1].role == "head"
    assert (untied[0].out_features, untied[0].in_features) == (320, 64)
    tied = embedding_specs(load_config(qwen2_ckpt))
    assert [(s.name, s.role) for s in tied] == [("model.embed_tokens", "embedding")]
    linear = scope_specs(load_config(llama_ckpt), None, "linear")
    assert all(s.role == "linear" for s in linear)
    assert [s for s in untied if s.role == "linear"] == linear


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_uniform_scope_all(kind: str, tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Untied (llama) and tied (qwen2) heads: every embedding row quantized at the same grid,
    whole-model bits per parameter down, bits per linear weight unchanged, the native model
    computes what the dequantized checkpoint does and writes itself back byte for byte."""
    ckpt = tiny_checkpoints[kind]
    lin = quantize_checkpoint(ckpt, tmp_path / "lin", HiggsConfig.from_bits(BITS))
    out = tmp_path / "all"
    rep = quantize_checkpoint(ckpt, out, HiggsConfig.from_bits(BITS, scope="all"))
    extra = {"llama": ["model.embed_tokens", "lm_head"], "qwen2": ["model.embed_tokens"]}[kind]
    rows = {r.name: r for r in rep.layers}
    for name in extra:
        assert (rows[name].p, rows[name].n) == (2, 64)
        assert rows[name].bits == pytest.approx(3.0 + 16 / 64)  # codes + one scale per 64
        assert 0 < rows[name].rel_error < 0.2
    assert not any(n in {r.name for r in lin.layers} for n in extra)
    assert rep.metrics["scope"] == "all"
    assert list(rep.metrics["embedding_layers"]) == extra
    assert rep.bits_per_weight == pytest.approx(lin.bits_per_weight)
    assert rep.params_total == lin.params_total
    assert rep.bits_per_param_total < 0.7 * lin.bits_per_param_total
    assert rep.bytes_after < lin.bytes_after
    # the file is what the report says
    assert rep.bytes_after * 8 / rep.params_total == pytest.approx(rep.bits_per_param_total)

    model: Any = load_model(out / "native")[0]
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    assert isinstance(emb, HiggsEmbedding) and isinstance(head, HiggsLinear)
    assert head.tied_to == ("model.embed_tokens" if kind == "qwen2" else None)
    # a lookup is the dequantized matrix's rows
    dense = dequantize_matrix(emb.quantized)
    got = emb(IDS).float()
    assert torch.allclose(got, dense[IDS].to(got.dtype), atol=1e-3)

    native, deq = _logits(out / "native"), _logits(out / "dequantized")
    scale = deq.abs().max()
    assert (native - deq).abs().max() < 0.01 * scale
    # scope all differs from the 16-bit embedding's logits (it did quantize something)
    assert (deq - _logits(tmp_path / "lin" / "dequantized")).abs().max() > 1e-3 * scale

    save_native(model, tmp_path / "resaved")
    assert filecmp.cmp(
        out / "native" / "model.safetensors",
        tmp_path / "resaved" / "model.safetensors",
        shallow=False,
    )


def test_skip_keeps_the_embedding_in_16_bits(llama_ckpt: Path, tmp_path: Path) -> None:
    cfg = HiggsConfig.from_bits(BITS, scope="all", skip=("model.embed_tokens",))
    rep = quantize_checkpoint(llama_ckpt, tmp_path / "out", cfg)
    rows = {r.name: r for r in rep.layers}
    assert rows["model.embed_tokens"].p == 0 and rows["lm_head"].p == 2
    assert rep.metrics["kept_16bit"] == {"model.embed_tokens": "skip pattern"}
    model: Any = load_model(tmp_path / "out" / "native")[0]
    assert isinstance(model.get_input_embeddings(), torch.nn.Embedding)
    assert isinstance(model.get_output_embeddings(), HiggsLinear)
    native, deq = _logits(tmp_path / "out" / "native"), _logits(tmp_path / "out" / "dequantized")
    assert (native - deq).abs().max() < 0.01 * deq.abs().max()


def test_sharded_scope_all_matches_a_single_run(
    sharded_ckpt: Path, llama_ckpt: Path, tmp_path: Path
) -> None:
    """A sharded source goes part by part: the embedding and head are quantized in the parts
    that hold them, and the assembled artifact loads like the single-file one."""
    cfg = HiggsConfig.from_bits(BITS, scope="all")
    rep = run(QuantizeJob(sharded_ckpt, cfg), tmp_path / "sharded")
    assert "parts" in rep.metrics
    rows = {r.name: r for r in rep.layers}
    assert rows["model.embed_tokens"].p == 2 and rows["lm_head"].p == 2
    single = quantize_checkpoint(llama_ckpt, tmp_path / "single", cfg)
    assert rep.bits_per_param_total == pytest.approx(single.bits_per_param_total)
    model: Any = load_model(tmp_path / "sharded" / "native")[0]
    assert isinstance(model.get_input_embeddings(), HiggsEmbedding)
    native, deq = _logits(tmp_path / "sharded" / "native"), _logits(tmp_path / "single" / "native")
    assert torch.allclose(native, deq, atol=1e-4)


def test_dynamic_scope_all_allocates_the_embedding(llama_ckpt: Path, tmp_path: Path) -> None:
    """The profile includes the embedding and head, the allocator picks their grids, and the
    avg_bits budget is met over every allocated parameter (linear, embedding, head)."""
    base = HiggsConfig(scope="all")
    names = allocated_layers(resolve_model(llama_ckpt), base)
    assert names[-2:] == ["model.embed_tokens", "lm_head"]
    assert "model.embed_tokens" not in allocated_layers(resolve_model(llama_ckpt), HiggsConfig())
    job = QuantizeJob(
        llama_ckpt,
        base,
        target=Target(avg_bits=2.5),
        profile=ProfileSource(
            config=ProfileConfig(data_free="random", context=32, windows=2),
            stores=(ProfileDirectory(tmp_path / "profiles"),),
            menu=tuple(option_menu(max_code_bits=3.0)),
        ),
    )
    alloc = run(job, tmp_path / "out").metrics["allocation"]
    assert set(alloc["layers"]) == set(names)
    assert alloc["avg_bits"] <= 2.5 + 1e-9
    rep = Report.load(tmp_path / "out" / "report.json")
    rows = {r.name: r for r in rep.layers}
    assert rows["model.embed_tokens"].alpha is not None and rows["lm_head"].alpha is not None
    # what was written: the allocated layers' bytes (grids included) within the budget
    allocated = sum(rows[n].bytes for n in names) + rep.metrics["grid_bytes"]
    numel = sum(rows[n].shape[0] * rows[n].shape[1] for n in names)
    assert 8 * allocated / numel <= 2.5 + 1e-6
    assert 8 * allocated / numel == pytest.approx(alloc["avg_bits"], abs=1e-6)
    native = _logits(tmp_path / "out" / "native")
    deq = _logits(tmp_path / "out" / "dequantized")
    assert (native - deq).abs().max() < 0.01 * deq.abs().max()


def test_a_linear_profile_is_extended_with_the_embedding(llama_ckpt: Path, tmp_path: Path) -> None:
    """The noise profile of the linear layers, found in the cache, is extended layer by layer
    when the embedding and head are asked for (not returned without them, nor re-measured)."""
    from devtools.profiles import obtain

    cfg = ProfileConfig(method="noise", data_free="random", context=32, windows=2)
    stores = [ProfileDirectory(tmp_path / "profiles")]
    lin = obtain(llama_ckpt, cfg, stores=stores).profile
    got = obtain(llama_ckpt, cfg, stores=stores, embeddings=True)
    assert got.reused is None  # measured (the missing layers), not taken as it was
    names = [la.name for la in got.profile.layers]
    assert names == [la.name for la in lin.layers] + ["model.embed_tokens", "lm_head"]
    assert got.profile.layers[: len(lin.layers)] == lin.layers
    again = obtain(llama_ckpt, cfg, stores=stores, embeddings=True)
    assert again.reused == "cache_dir"
    assert obtain(llama_ckpt, cfg, stores=stores).reused == "cache_dir"
