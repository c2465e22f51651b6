"""A sharded checkpoint quantized part by part and assembled (higgs_engine.parts)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from higgs_engine.artifacts import load_model
from higgs_engine.errors import CancelledError, CorruptCheckpointError, InvalidConfigError
from higgs_engine.job import QuantizeJob, run
from higgs_engine.parts import (
    Part,
    PartResult,
    assemble_metadata,
    assemble_parts,
    list_parts,
    part_context,
    part_shard_files,
    planned_layers,
    quantize_part,
    read_part,
    source_parts,
)
from higgs_engine.pipeline import quantize_checkpoint
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.progress import ProgressCallback
from higgs_engine.report import Report
from higgs_engine.safetensors_stream import SHARD_INDEX, read_weight_map
from higgs_engine.sources import ResolvedModel, resolve_model

CFG = HiggsConfig(p=2, n=256)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def digests(root: Path) -> dict[str, str]:
    """sha256 of every file under the format directories of an output directory."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for fmt in ("native", "dequantized")
        for p in sorted((root / fmt).rglob("*"))
        if p.is_file()
    }


def tensors(fmt_dir: Path) -> dict[str, bytes]:
    """Every tensor of a (sharded or single-file) format directory, as raw bytes."""
    out: dict[str, bytes] = {}
    for f in sorted(fmt_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                t = h.get_tensor(k)
                out[k] = (
                    t.contiguous().view(torch.uint8).numpy().tobytes()
                    + str((t.dtype, tuple(t.shape))).encode()
                )
    return out


def qpart(
    src: Path,
    part: Part,
    out: Path,
    cfg: HiggsConfig,
    progress: ProgressCallback | None = None,
    n_parts: int | None = None,
) -> PartResult:
    return quantize_part(part_context(resolve_model(src), out, cfg, progress), part, n_parts)


def assemble_dirs(src: Path, dirs: list[Path], out: Path, cfg: HiggsConfig) -> Report:
    return assemble_parts(part_context(resolve_model(src), out, cfg), dirs)


def parts_of(src: Path) -> list[Part]:
    return source_parts(resolve_model(src))


def model(src: Path) -> ResolvedModel:
    return resolve_model(src)


def test_list_parts_is_a_pure_function_of_the_weight_map() -> None:
    wm = {
        "a": "s-2.safetensors",
        "b": "s-1.safetensors",
        "c": "s-3.safetensors",
        "d": "s-1.safetensors",
    }
    assert list_parts(wm) == [
        Part(0, ("s-1.safetensors",)),
        Part(1, ("s-2.safetensors",)),
        Part(2, ("s-3.safetensors",)),
    ]
    assert list_parts(wm, 2) == [
        Part(0, ("s-1.safetensors", "s-2.safetensors")),
        Part(1, ("s-3.safetensors",)),
    ]
    with pytest.raises(InvalidConfigError, match="shards_per_part must be at least 1, not 0"):
        list_parts(wm, 0)


@pytest.fixture(scope="module")
def parts_out(sharded_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("parts")
    parts = parts_of(sharded_ckpt)
    assert len(parts) >= 3
    dirs = []
    for p in parts:
        qpart(sharded_ckpt, p, root / f"p{p.index}", CFG)
        dirs.append(root / f"p{p.index}")
    return dirs


def test_any_assembly_order_gives_byte_identical_files(
    sharded_ckpt: Path, parts_out: list[Path], tmp_path: Path
) -> None:
    first = assemble_dirs(sharded_ckpt, parts_out, tmp_path / "a", CFG)
    want = digests(tmp_path / "a")
    n = len(parts_out)
    assert f"native/model-{n + 1:05d}-of-{n + 1:05d}.safetensors" in want  # the grid shard
    assert f"dequantized/model-{n:05d}-of-{n:05d}.safetensors" in want
    assert f"native/{SHARD_INDEX}" in want and f"dequantized/{SHARD_INDEX}" in want
    orders = [list(reversed(parts_out)), [parts_out[1], parts_out[0], *parts_out[2:]]]
    orders.append(sorted(parts_out, key=lambda p: hashlib.md5(p.name.encode()).hexdigest()))
    for i, order in enumerate(orders):
        rep = assemble_dirs(sharded_ckpt, order, tmp_path / f"o{i}", CFG)
        assert digests(tmp_path / f"o{i}") == want
        assert [r.__dict__ for r in rep.layers] == [r.__dict__ for r in first.layers]
    # the index names every tensor of its shards, and sizes add up
    idx = json.loads((tmp_path / "a" / "native" / SHARD_INDEX).read_text())
    got = tensors(tmp_path / "a" / "native")
    assert set(idx["weight_map"]) == set(got)
    assert [p["index"] for p in first.metrics["parts"]] == list(range(n))


def test_parts_write_final_shard_names_and_the_metadata_assembly_reads_none(
    sharded_ckpt: Path, parts_out: list[Path], tmp_path: Path
) -> None:
    """Each part's shard files carry their names in the assembled artifact and the sha256
    part.json records; assemble_metadata writes only the small files (no part's shard is
    read: the parts' directories may be gone), and those plus the parts' shards are exactly
    the files of a full assembly, byte for byte."""
    n = len(parts_out)
    metas = [read_part(d) for d in parts_out]
    for m, d in zip(metas, parts_out, strict=True):
        want = part_shard_files(m["index"], n, CFG.formats, True)
        assert sorted(m["files"]) == sorted(want.values())
        for rel, f in m["files"].items():
            data = (d / rel).read_bytes()
            assert (len(data), hashlib.sha256(data).hexdigest()) == (f["bytes"], f["sha256"])
    full = assemble_dirs(sharded_ckpt, parts_out, tmp_path / "full", CFG)
    gone = tmp_path / "gone"  # metadata only: the shard files are not there at all
    rep = assemble_metadata(part_context(model(sharded_ckpt), gone, CFG), list(reversed(metas)))
    small = digests(gone)
    from_parts = {rel: f["sha256"] for m in metas for rel, f in m["files"].items()}
    assert not set(small) & set(from_parts)
    assert {**small, **from_parts} == digests(tmp_path / "full")
    assert sorted(small) == sorted(
        [f"native/model-{n + 1:05d}-of-{n + 1:05d}.safetensors"]  # the grids shard
        + [
            f"{fmt}/{p.name}"
            for fmt in ("native", "dequantized")
            for p in (tmp_path / "full" / fmt).iterdir()
            if not p.name.startswith("model-") or p.name == SHARD_INDEX
        ]
    )
    # the report lists every file with its size, the parts' shards included
    assert rep.metrics["files"] == full.metrics["files"]
    assert list(rep.metrics["files"]["native"]) == sorted(
        p.name for p in (tmp_path / "full" / "native").iterdir()
    )
    assert (gone / "report.json").is_file()


def test_assembled_equals_single_run_per_tensor(
    sharded_ckpt: Path,
    llama_ckpt: Path,
    parts_out: list[Path],
    tmp_path: Path,
) -> None:
    """Same model saved unsharded, quantized by one single-file run: every tensor, the
    quantization entries and the report's per-layer rows are the same."""
    rep = assemble_dirs(sharded_ckpt, parts_out, tmp_path / "a", CFG)
    single = quantize_checkpoint(llama_ckpt, tmp_path / "s", CFG)
    assert (tmp_path / "s" / "native" / "model.safetensors").is_file()
    assert not (tmp_path / "s" / "native" / SHARD_INDEX).exists()
    for fmt in ("native", "dequantized"):
        assert tensors(tmp_path / "a" / fmt) == tensors(tmp_path / "s" / fmt)
    qa = json.loads((tmp_path / "a" / "native" / "config.json").read_text())
    qs = json.loads((tmp_path / "s" / "native" / "config.json").read_text())
    assert qa == qs
    assert [r.__dict__ for r in rep.layers] == [r.__dict__ for r in single.layers]
    assert (rep.bits_per_weight, rep.bytes_after, rep.params_total, rep.bytes_before) == (
        single.bits_per_weight,
        single.bytes_after,
        single.params_total,
        single.bytes_before,
    )
    # one part holding every shard: same tensors again, in one shard
    one = Part(0, tuple(sorted(set((read_weight_map(sharded_ckpt) or {}).values()))))
    qpart(sharded_ckpt, one, tmp_path / "one", CFG, None, 1)
    assemble_dirs(sharded_ckpt, [tmp_path / "one"], tmp_path / "b", CFG)
    assert sorted(p.name for p in (tmp_path / "b" / "native").glob("model-*")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert tensors(tmp_path / "b" / "native") == tensors(tmp_path / "s" / "native")


def test_a_run_of_a_sharded_source_is_the_assembly(
    sharded_ckpt: Path, parts_out: list[Path], tmp_path: Path
) -> None:
    seen: list[tuple[str, int, int]] = []

    def progress(stage: str, done: int, total: int) -> bool:
        seen.append((stage, done, total))
        return True

    rep = run(QuantizeJob(sharded_ckpt, CFG), tmp_path / "q", progress)
    assemble_dirs(sharded_ckpt, parts_out, tmp_path / "a", CFG)
    assert digests(tmp_path / "q") == digests(tmp_path / "a")
    quant = [(d, t) for s, d, t in seen if s == "quantizing"]
    total = len([r for r in rep.layers if r.p])
    assert quant[-1] == (total, total) and all(t == total for _, t in quant)
    assert [d for d, _ in quant] == sorted(d for d, _ in quant)  # adds up across parts
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "q"]  # no scratch left


def test_sharded_artifacts_load_like_single_file_ones(
    sharded_ckpt: Path, llama_ckpt: Path, parts_out: list[Path], tmp_path: Path
) -> None:
    assemble_dirs(sharded_ckpt, parts_out, tmp_path / "a", CFG)
    quantize_checkpoint(llama_ckpt, tmp_path / "s", CFG)
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    for fmt in ("native", "dequantized"):
        m_a, _ = load_model(tmp_path / "a" / fmt)
        m_s, _ = load_model(tmp_path / "s" / fmt)
        with torch.no_grad():
            assert torch.equal(m_a(ids).logits, m_s(ids).logits)


def test_a_part_reads_only_its_own_shards(sharded_ckpt: Path, tmp_path: Path) -> None:
    parts = parts_of(sharded_ckpt)
    src = tmp_path / "src"
    shutil.copytree(sharded_ckpt, src)
    for other in parts[1:]:
        for shard in other.shards:
            (src / shard).unlink()
    res = qpart(src, parts[0], tmp_path / "p0", CFG)
    assert res.meta["shards"] == list(parts[0].shards)
    n = len(parts)
    assert (tmp_path / "p0" / "native" / f"model-00001-of-{n + 1:05d}.safetensors").is_file()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        qpart(src, parts[1], tmp_path / "p1", CFG)
    assert not (tmp_path / "p1").exists()


def test_planned_layers_add_up(sharded_ckpt: Path) -> None:
    parts = parts_of(sharded_ckpt)
    counts = planned_layers(model(sharded_ckpt), parts, CFG)
    rep_layers = 2 * 7  # tiny llama: 2 blocks x (q, k, v, o, gate, up, down)
    assert sum(counts.values()) == rep_layers and set(counts) == {p.index for p in parts}


def test_cancel_and_bad_assembly(sharded_ckpt: Path, parts_out: list[Path], tmp_path: Path) -> None:
    part = next(
        p for p, n in planned_layers(model(sharded_ckpt), parts_of(sharded_ckpt), CFG).items() if n
    )
    with pytest.raises(CancelledError):
        qpart(
            sharded_ckpt, parts_of(sharded_ckpt)[part], tmp_path / "c", CFG, lambda s, d, t: d == 0
        )
    assert not (tmp_path / "c").exists()
    with pytest.raises(InvalidConfigError, match="not every part"):
        assemble_dirs(sharded_ckpt, parts_out[1:], tmp_path / "x", CFG)
    with pytest.raises(InvalidConfigError, match="another config"):
        assemble_dirs(sharded_ckpt, parts_out, tmp_path / "y", HiggsConfig(p=2, n=64))
    # a part quantized as one of another number of parts names other shard files
    qpart(sharded_ckpt, parts_of(sharded_ckpt)[0], tmp_path / "w", CFG, None, 9)
    with pytest.raises(InvalidConfigError, match="as part of 9; an assembly of"):
        assemble_dirs(sharded_ckpt, [tmp_path / "w", *parts_out[1:]], tmp_path / "z", CFG)
    with pytest.raises(InvalidConfigError, match="part index 3 is not one of 2 parts"):
        qpart(sharded_ckpt, Part(3, ("x",)), tmp_path / "v", CFG, None, 2)
    for d in ("x", "y", "z", "v"):
        assert not (tmp_path / d).exists()


def test_per_layer_choices_are_an_input_of_each_part(
    sharded_ckpt: Path, llama_ckpt: Path, tmp_path: Path
) -> None:
    """A dynamic plan's per-layer grids (overrides, some layers kept 16-bit) reach every part:
    the assembly holds the same tensors as a single-file run with the same choices."""
    from higgs_engine.planning.config import LayerOverride

    cfg = HiggsConfig(
        p=2,
        n=256,
        overrides=(
            LayerOverride("model.layers.0.self_attn.q_proj", 2, 64),
            LayerOverride("model.layers.1.mlp.down_proj", 0, 0),
            LayerOverride("model.layers.1.mlp.up_proj", 1, 16),
        ),
    )
    dirs = []
    for p in parts_of(sharded_ckpt):
        qpart(sharded_ckpt, p, tmp_path / f"p{p.index}", cfg)
        dirs.append(tmp_path / f"p{p.index}")
    rep = assemble_dirs(sharded_ckpt, dirs, tmp_path / "a", cfg)
    single = quantize_checkpoint(llama_ckpt, tmp_path / "s", cfg)
    for fmt in ("native", "dequantized"):
        assert tensors(tmp_path / "a" / fmt) == tensors(tmp_path / "s" / fmt)
    grids = {r.name: (r.p, r.n) for r in rep.layers}
    assert grids["model.layers.0.self_attn.q_proj"] == (2, 64)
    assert grids["model.layers.1.mlp.down_proj"] == (0, 0)
    assert grids["model.layers.1.mlp.up_proj"] == (1, 16)
    assert [r.__dict__ for r in rep.layers] == [r.__dict__ for r in single.layers]
