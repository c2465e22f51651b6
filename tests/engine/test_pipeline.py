"""quantize_checkpoint end to end on tiny real checkpoints: report figures checked against the
written files, progress / cancellation, atomic output, overrides, skip, odd shapes, sources."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from higgs_engine.artifacts import load_model
from higgs_engine.errors import (
    CancelledError,
    CorruptCheckpointError,
    InvalidConfigError,
    ModelNotFoundError,
)
from higgs_engine.job import QuantizeJob, run
from higgs_engine.methods import METHODS, Precision
from higgs_engine.model_structure import quantizable_layers
from higgs_engine.output import OutputExistsError
from higgs_engine.pipeline import quantize_checkpoint
from higgs_engine.planning.config import HiggsConfig, LayerOverride
from higgs_engine.quantize import dequantize_matrix, relative_error
from higgs_engine.report import Report
from higgs_engine.sources import describe_model, resolve_source

CFG = HiggsConfig(p=2, n=256)


def _native_tensors(out: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(out / "native" / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@pytest.fixture(scope="module")
def llama_out(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Report]:
    out = tmp_path_factory.mktemp("q") / "llama_q"
    return out, quantize_checkpoint(llama_ckpt, out, CFG)


def test_outputs_and_report_file(llama_out: tuple[Path, Report]) -> None:
    out, rep = llama_out
    assert sorted(p.name for p in out.iterdir()) == ["dequantized", "native", "report.json"]
    for fmt in ("native", "dequantized"):
        names = {p.name for p in (out / fmt).iterdir()}
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    assert Report.load(out / "report.json").to_dict() == rep.to_dict()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
    assert rep.seed == CFG.seed and rep.formats == ["native", "dequantized"]
    assert set(rep.versions) >= {"torch", "transformers", "higgs_engine"}
    assert set(rep.timings) >= {"resolving", "loading", "quantizing", "packaging", "total"}
    assert rep.source["architecture"] == "LlamaForCausalLM" and rep.source["revision"] is None


def test_report_figures_match_the_written_files(
    llama_out: tuple[Path, Report], llama_ckpt: Path
) -> None:
    out, rep = llama_out
    tensors = _native_tensors(out)
    names = quantizable_layers(llama_ckpt)
    assert [r.name for r in rep.layers] == names
    # bytes_after: every tensor of the native file
    assert rep.bytes_after == sum(t.numel() * t.element_size() for t in tensors.values())
    # per layer: codes + scales as stored
    for r in rep.layers:
        stored = sum(
            t.numel() * t.element_size()
            for k, t in tensors.items()
            if k.startswith(r.name + ".higgs.")
        )
        assert r.bytes == stored and r.p == 2 and r.n == 256
        assert r.bits == pytest.approx(8 * stored / (r.shape[0] * r.shape[1]))
    # bits_per_weight: codes + scales of every linear layer + the grid, over linear weights
    grid = tensors["higgs.grid.p2.n256"]
    numel = sum(r.shape[0] * r.shape[1] for r in rep.layers)
    expected = 8 * (sum(r.bytes for r in rep.layers) + grid.numel() * 4) / numel
    assert rep.bits_per_weight == pytest.approx(expected)
    # narrow tiny layers: one fp16 scale per 64-wide row (in=64) or per 64 + 32 block (in=96)
    for r in rep.layers:
        scales_per_row = {64: 1, 96: 2}[r.shape[1]]
        assert r.bits == pytest.approx(4 + 16 * scales_per_row / r.shape[1])
    assert rep.params_quantized == numel
    src_bytes = (llama_ckpt / "model.safetensors").stat().st_size
    assert rep.bytes_before < src_bytes < rep.bytes_before + 10_000  # tensor bytes + header
    assert rep.bits_per_param_total == pytest.approx(8 * rep.bytes_after / rep.params_total)


def test_rel_error_is_the_dequantized_error(
    llama_out: tuple[Path, Report], llama_ckpt: Path
) -> None:
    out, rep = llama_out
    from safetensors.torch import load_file

    src = load_file(str(llama_ckpt / "model.safetensors"))
    deq = load_file(str(out / "dequantized" / "model.safetensors"))
    for r in rep.layers:
        w = src[r.name + ".weight"].float()
        # the dequantized file holds W_hat rounded to fp16
        assert relative_error(w, deq[r.name + ".weight"].float()) == pytest.approx(
            r.rel_error, rel=0.02
        )
        assert 0.0 < r.rel_error < 0.05


def test_the_run_cores_layer_method_is_reusable(llama_ckpt: Path) -> None:
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(0))
    res = METHODS["higgs"].quantize(w, Precision(grid=(1, 16)), CFG)
    q = res.quantized
    assert q is not None and (q.p, q.n, q.layout) == (1, 16, [64, 32])
    assert relative_error(w, res.w_hat) == pytest.approx(relative_error(w, dequantize_matrix(q)))


def test_progress_stages_and_layer_counts(llama_ckpt: Path, tmp_path: Path) -> None:
    calls: list[tuple[str, int, int]] = []
    quantize_checkpoint(llama_ckpt, tmp_path / "o", CFG, lambda s, d, t: calls.append((s, d, t)))
    stages = [c[0] for c in calls]
    order = ["resolving", "loading", "quantizing", "packaging"]
    assert [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s] == order
    q = [c for c in calls if c[0] == "quantizing"]
    assert [c[1] for c in q] == list(range(15)) and all(c[2] == 14 for c in q)
    assert calls[-1] == ("packaging", 1, 1)


@pytest.mark.parametrize("how", ["return_false", "raise"])
def test_cancel_leaves_nothing(llama_ckpt: Path, tmp_path: Path, how: str) -> None:
    def cb(stage: str, done: int, total: int) -> bool:
        if stage == "quantizing" and done == 3:
            if how == "raise":
                raise CancelledError("stop")
            return False
        return True

    out = tmp_path / "nested" / "out"
    with pytest.raises(CancelledError):
        quantize_checkpoint(llama_ckpt, out, CFG, cb)
    assert list(tmp_path.iterdir()) == []  # no out dir, no temp dir, no created parents


def test_error_midway_leaves_nothing(llama_ckpt: Path, tmp_path: Path) -> None:
    bad = tmp_path / "trunc"
    shutil.copytree(llama_ckpt, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: int(len(data) * 0.7)])
    with pytest.raises(CorruptCheckpointError):
        quantize_checkpoint(bad, tmp_path / "out", CFG)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trunc"]


def test_existing_output_is_refused_unless_overwrite(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    quantize_checkpoint(
        llama_ckpt,
        out,
        CFG,
    )  # an empty directory is fine
    before = (out / "report.json").read_text()
    with pytest.raises(OutputExistsError, match="already exists"):
        quantize_checkpoint(llama_ckpt, out, CFG)
    assert (out / "report.json").read_text() == before  # untouched
    rep = quantize_checkpoint(llama_ckpt, out, HiggsConfig(p=1, n=8), overwrite=True)
    assert json.loads((out / "report.json").read_text())["config"]["n"] == 8 == rep.config["n"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(ModelNotFoundError):
        quantize_checkpoint(tmp_path / "missing", tmp_path / "o2", CFG)
    assert not (tmp_path / "o2").exists()


def test_overrides_skip_and_mixed_grids(llama_ckpt: Path, tmp_path: Path) -> None:
    cfg = HiggsConfig(
        p=2,
        n=256,
        skip=("*.self_attn.k_proj",),
        overrides=(
            LayerOverride("model.layers.0.mlp.down_proj", 0, 0),
            LayerOverride("model.layers.1.mlp.up_proj", 1, 16),
            LayerOverride("model.layers.1.self_attn.q_proj", 2, 64),
        ),
    )
    rep = quantize_checkpoint(llama_ckpt, tmp_path / "o", cfg)
    rows = {r.name: r for r in rep.layers}
    assert (
        rows["model.layers.0.self_attn.k_proj"].p == 0
        and rows["model.layers.1.self_attn.k_proj"].p == 0
    )
    assert (
        rows["model.layers.0.mlp.down_proj"].p == 0
        and rows["model.layers.0.mlp.down_proj"].bits == 16
    )
    assert (rows["model.layers.1.mlp.up_proj"].p, rows["model.layers.1.mlp.up_proj"].n) == (1, 16)
    assert rows["model.layers.1.self_attn.q_proj"].n == 64
    kept = rep.metrics["kept_16bit"]
    assert kept["model.layers.0.self_attn.k_proj"] == "skip pattern"
    assert kept["model.layers.0.mlp.down_proj"] == "override keeps 16 bits"
    tensors = _native_tensors(tmp_path / "o")
    assert {k for k in tensors if k.startswith("higgs.grid")} == {
        "higgs.grid.p2.n256",
        "higgs.grid.p1.n16",
        "higgs.grid.p2.n64",
    }
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float16
    model, _ = load_model(tmp_path / "o", dtype=torch.float32)
    from higgs_engine.modules import HiggsLinear

    assert isinstance(model.get_submodule("model.layers.1.mlp.up_proj"), HiggsLinear)
    assert isinstance(model.get_submodule("model.layers.0.mlp.down_proj"), torch.nn.Linear)
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(20).unsqueeze(0)).logits).all()
    with pytest.raises(InvalidConfigError, match="does not have"):
        quantize_checkpoint(
            llama_ckpt, tmp_path / "o3", HiggsConfig(overrides=(LayerOverride("nope", 0, 0),))
        )


def test_odd_in_features_stay_16bit(tmp_path: Path) -> None:
    from tests.fixtures import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint("llama", tmp_path / "odd", intermediate_size=99, tokenizer=False)
    rep = quantize_checkpoint(ckpt, tmp_path / "o", CFG)
    downs = [r for r in rep.layers if r.name.endswith("down_proj")]
    assert downs and all(r.p == 0 for r in downs)
    assert "not divisible by p=2" in rep.metrics["kept_16bit"][downs[0].name]
    ups = [r for r in rep.layers if r.name.endswith("up_proj")]
    assert all(r.p == 2 for r in ups)  # (99, 64): out=99 is fine
    rep1 = quantize_checkpoint(ckpt, tmp_path / "o1", HiggsConfig(p=1, n=16))
    assert all(r.p == 1 for r in rep1.layers)  # 99 = 64 + 32 + 2 + 1 blocks, no padding


def test_single_format(llama_ckpt: Path, tmp_path: Path) -> None:
    rep = quantize_checkpoint(llama_ckpt, tmp_path / "o", HiggsConfig(formats=("dequantized",)))
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["dequantized", "report.json"]
    assert rep.formats == ["dequantized"] and rep.bytes_after > 0


def test_sharded_source_gives_identical_artifact(
    llama_out: tuple[Path, Report], sharded_ckpt: Path, tmp_path: Path
) -> None:
    """A sharded source gives sharded artifacts (higgs_engine.parts) holding the same tensors,
    byte for byte, as the single-file artifacts of the same model saved unsharded."""
    from safetensors import safe_open

    def tensors(fmt_dir: Path) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for f in sorted(fmt_dir.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():  # noqa: SIM118
                    out[k] = h.get_tensor(k).contiguous().view(torch.uint8).numpy().tobytes()
        return out

    out, rep = llama_out
    rep2 = run(QuantizeJob(sharded_ckpt, CFG), tmp_path / "o")
    for fmt in ("native", "dequantized"):
        assert (tmp_path / "o" / fmt / "model.safetensors.index.json").is_file()
        assert tensors(out / fmt) == tensors(tmp_path / "o" / fmt)
    assert rep2.bytes_before == rep.bytes_before


def test_hub_id_records_commit_sha(llama_ckpt: Path, tmp_path: Path) -> None:
    sha = "89abcdef0123456789abcdef0123456789abcdef"
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "snapshots" / sha).mkdir(parents=True)
    for f in llama_ckpt.iterdir():
        shutil.copy(f, repo / "snapshots" / sha / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    found = resolve_source("org/tiny", hub_cache_dir=tmp_path / "hub", local_files_only=True)
    rep = quantize_checkpoint(describe_model(found), tmp_path / "o", CFG)
    assert (
        rep.source["revision"] == sha
        and rep.source["kind"] == "hub"
        and rep.source["id"] == "org/tiny"
    )


@pytest.mark.parametrize("kind", ["qwen2", "gemma2", "gpt2"])
def test_other_architectures_quantize_and_run(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    rep = quantize_checkpoint(tiny_checkpoints[kind], tmp_path / "o", CFG)
    assert all(r.p == 2 for r in rep.layers)
    assert rep.metrics["mean_rel_error"] < 0.05
    model, tok = load_model(tmp_path / "o" / "native", dtype=torch.float32)
    assert tok is not None
    ids = torch.tensor([tok("the library was the heart of town")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 320) and torch.isfinite(logits).all()
