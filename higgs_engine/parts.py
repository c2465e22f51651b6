"""One checkpoint quantized part by part, and the artifacts assembled from the parts.

Data-free HIGGS quantizes every layer on its own, so a sharded source can be split: a part is
one or more of its safetensors shards (`list_parts`, a pure function of the shard index).
`quantize_part` reads only its part's shards and writes, per format, the artifact shard of
the tensors those shards hold (quantized layers as codes + scales in `native`, as 16-bit
weights in `dequantized`), already under its final name in the assembled artifact (part i of
n -> `model-0000{i+1}-of-0000N.safetensors`, N known from the shard index and the config
alone), and `part.json` (what the assembly needs: layer rows, the layers' quantization
entries, the grids used, tensor names, and each shard file's size and sha256). Parts may run
in different processes or on different machines; per-layer choices (a dynamic plan's grids)
come in with the HiggsConfig (its overrides), so every part quantizes exactly what a single
run would.

`assemble_metadata` writes only the small files of the assembled artifacts from the parts'
metadata (no part's shard is read): the indexes, configs and tokenizer files, the grids shard
and report.json, so that parts' shards written straight to where the artifact is published
need no second copy. `assemble_parts` does the same and moves (or copies) the parts' shards
beside them, giving the usual output directory, sharded as transformers writes large models:

    native/model-00001-of-00007.safetensors ... (part i -> shard i+1; the grids in the last)
    native/model.safetensors.index.json         {"metadata": {"total_size": N}, "weight_map"}
    native/config.json                          quantization_config of every part's layers
    dequantized/model-00001-of-00006.safetensors ... + index, config.json
    report.json

Each part's file is written by the streaming writer (tensors ordered by name) and depends only
on its shards and the config; the assembly orders parts by index, so assembling the same parts
in any order gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError
from higgs_engine.formats import format_writer
from higgs_engine.model_structure import LayerSpec
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.progress import ProgressCallback, report
from higgs_engine.report import LayerReport, Report
from higgs_engine.run_core import (
    LayerPlan,
    RunContext,
    Written,
    build_report,
    plan_layers,
    stream_tensors,
)
from higgs_engine.safetensors_stream import (
    SHARD_INDEX,
    CheckpointReader,
    StreamingSafetensorsWriter,
)

if TYPE_CHECKING:
    from higgs_engine.sources import ResolvedModel

# What a caller adds to the report, given the output directory, before report.json.
Annotate = Callable[[Report, Path], None]

PART_META = "part.json"
PART_FORMAT_VERSION = 2


@dataclass(frozen=True)
class Part:
    """One part of a sharded source: its index (0-based) and the shard files it reads."""

    index: int
    shards: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "shards": list(self.shards)}


def list_parts(weight_map: Mapping[str, str], shards_per_part: int = 1) -> list[Part]:
    """The parts of a sharded source from its shard index's weight_map ({tensor: shard file}):
    the shard files sorted by name, `shards_per_part` consecutive ones per part."""
    if shards_per_part < 1:
        raise InvalidConfigError(f"shards_per_part must be at least 1, not {shards_per_part}")
    shards = sorted(set(weight_map.values()))
    return [
        Part(i, tuple(shards[j : j + shards_per_part]))
        for i, j in enumerate(range(0, len(shards), shards_per_part))
    ]


def source_parts(model: ResolvedModel, shards_per_part: int = 1) -> list[Part]:
    """The parts of the checkpoint (one part holding model.safetensors when it has no shard
    index)."""
    if model.weight_map is None:
        return [Part(0, ("model.safetensors",))]
    return list_parts(model.weight_map, shards_per_part)


def shard_name(i: int, n: int) -> str:
    """transformers' name for shard i (0-based) of n."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def shard_counts(n_parts: int, formats: Sequence[str], with_grids: bool) -> dict[str, int]:
    """Shards per format of an artifact assembled from n_parts parts, as each format's writer
    says (native: one more for the grids when any layer is quantized)."""
    return {fmt: format_writer(fmt).shard_count(n_parts, with_grids) for fmt in formats}


def part_shard_files(
    index: int, n_parts: int, formats: Sequence[str], with_grids: bool
) -> dict[str, str]:
    """{format: path inside the artifact} of part `index`'s shard files."""
    counts = shard_counts(n_parts, formats, with_grids)
    return {fmt: f"{fmt}/{shard_name(index, counts[fmt])}" for fmt in formats}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _plans(model: ResolvedModel, config: HiggsConfig) -> tuple[list[LayerSpec], list[LayerPlan]]:
    if model.weight_map is None:
        raise CorruptCheckpointError(f"{str(model.path)!r} has no {SHARD_INDEX}; it is not sharded")
    specs = model.specs(config.scope)
    return specs, plan_layers(specs, config)


def planned_layers(
    model: ResolvedModel, parts: Sequence[Part], config: HiggsConfig
) -> dict[int, int]:
    """{part index: layers it quantizes} from the shard index alone (for progress totals)."""
    weight_map = model.weight_map or {}
    _, plans = _plans(model, config)
    where = {shard: p.index for p in parts for shard in p.shards}
    out = {p.index: 0 for p in parts}
    for pl in plans:
        if pl.grid is not None and weight_map.get(pl.spec.key) in where:
            out[where[weight_map[pl.spec.key]]] += 1
    return out


# ---------------------------------------------------------------------------------------------
# One part
# ---------------------------------------------------------------------------------------------


@dataclass
class PartResult:
    """What quantize_part wrote (the content of part.json)."""

    meta: dict[str, Any]
    seconds: float


def part_context(
    model: ResolvedModel,
    out_dir: Path,
    config: HiggsConfig,
    progress: ProgressCallback | None = None,
    device: str | None = None,
) -> RunContext:
    """The run context of one part (or of the assembly) of `model` into `out_dir`."""
    from higgs_engine.device import resolve_device

    return RunContext(
        model=model,
        tmp=Path(out_dir),
        config=config,
        progress=progress,
        device=resolve_device(device or "cpu"),
    )


def quantize_part(ctx: RunContext, part: Part, n_parts: int | None = None) -> PartResult:
    """Quantize the tensors of `part`'s shards of the sharded checkpoint ctx.model into
    ctx.tmp (which must not exist; removed again on any error or cancellation).

    ctx.tmp gets, per format, the part's shard under its name in the assembled artifact
    (`<format>/model-0000{i+1}-of-0000N.safetensors`; n_parts: how many parts the source is
    split into, default one per shard) and part.json, whose "files" lists each shard's path,
    bytes and sha256. Only the part's shards are opened (the model's config and shard index
    were read when it was resolved). ctx.progress is called with stage "quantizing"
    (done/total = this part's layers); returning False cancels.
    """
    t0 = time.perf_counter()
    out_dir = ctx.tmp
    if out_dir.exists():
        raise FileExistsError(f"part output {str(out_dir)!r} already exists")
    _, plans = _plans(ctx.model, ctx.config)
    if n_parts is None:
        n_parts = len(source_parts(ctx.model))
    if not 0 <= part.index < n_parts:
        raise InvalidConfigError(f"part index {part.index} is not one of {n_parts} parts")
    with_grids = any(pl.grid is not None for pl in plans)
    names = part_shard_files(part.index, n_parts, ctx.config.formats, with_grids)
    out_dir.mkdir(parents=True)
    try:
        with CheckpointReader(ctx.model.path, files=part.shards) as reader:
            meta = _write_part(ctx, reader, [pl for pl in plans if pl.spec.key in reader], names)
        meta.update({**part.to_dict(), "n_parts": n_parts})
        seconds = time.perf_counter() - t0
        meta["seconds"] = round(seconds, 6)
        (out_dir / PART_META).write_text(json.dumps(meta, indent=1, sort_keys=True))
        return PartResult(meta, seconds)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _write_part(
    ctx: RunContext, reader: CheckpointReader, mine: list[LayerPlan], names: dict[str, str]
) -> dict[str, Any]:
    """The part's tensors streamed into its shard files (renamed to `names`); returns the
    part's metadata but its index, shards and seconds."""
    from higgs_engine.artifacts import ArtifactWriter

    config, out_dir = ctx.config, ctx.tmp
    total = sum(1 for pl in mine if pl.grid is not None)
    report(ctx.progress, "quantizing", 0, total)
    writer = ArtifactWriter(
        out_dir, config.formats, config.dtype, ctx.model.path, config.to_dict(),
        grids_in_native=False,
    )  # fmt: skip
    try:
        rows = stream_tensors(ctx, reader, mine, writer, {}, total)
        sizes = writer.finish_part()
    except BaseException:
        writer.abort()
        raise
    files: dict[str, dict[str, Any]] = {}
    for fmt, rel in names.items():
        os.replace(out_dir / fmt / "model.safetensors", out_dir / rel)
        files[rel] = {"bytes": (out_dir / rel).stat().st_size}
        files[rel]["sha256"] = _sha256(out_dir / rel)
    keys = reader.keys()
    return {
        "format_version": PART_FORMAT_VERSION,
        "files": files,
        "config": config.to_dict(),
        "keys": keys,
        "params": sum(reader.numel(k) for k in keys),
        "bytes_before": reader.total_bytes,
        "native_bytes": writer.native_bytes - writer.grid_bytes,
        "grids": [list(g) for g in writer.grids_used],
        "layers": writer.layers_config(),
        "kept": writer.kept_layers,
        "rows": {name: row.__dict__ for name, row in rows.items()},
        "tensors": {
            fmt: {"names": writer.tensor_names(fmt), "bytes": sizes[fmt]} for fmt in config.formats
        },
    }


def read_part(part_dir: Path) -> dict[str, Any]:
    """A part's part.json, checked enough that a wrong directory fails clearly."""
    path = Path(part_dir) / PART_META
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"cannot read part metadata {str(path)!r}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format_version") != PART_FORMAT_VERSION:
        raise CorruptCheckpointError(f"{str(path)!r} is not a part of format {PART_FORMAT_VERSION}")
    return meta


# ---------------------------------------------------------------------------------------------
# Assembly
# ---------------------------------------------------------------------------------------------


def _place(src: Path, dst: Path, move: bool) -> None:
    if move:
        os.replace(src, dst)
    else:
        shutil.copyfile(src, dst)


def _write_index(fmt_dir: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (fmt_dir / SHARD_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def check_parts(metas: Sequence[Mapping[str, Any]], config: HiggsConfig) -> list[dict[str, Any]]:
    """Every part's metadata (part.json) sorted by index, checked to be every part 0..n-1
    exactly once, of this config, naming the shard files an assembly of n parts expects."""
    ordered = sorted((dict(m) for m in metas), key=lambda m: int(m.get("index", -1)))
    n = len(ordered)
    for m in ordered:
        if m.get("format_version") != PART_FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"part {m.get('index')!r} is not a part of format {PART_FORMAT_VERSION}"
            )
    if [m["index"] for m in ordered] != list(range(n)) or not n:
        raise InvalidConfigError(
            f"parts {[m['index'] for m in ordered]} are not every part 0..{n - 1} exactly once"
        )
    with_grids = any(m["grids"] for m in ordered)
    for m in ordered:
        if m["config"] != config.to_dict():
            raise InvalidConfigError(f"part {m['index']} was quantized with another config")
        want = set(part_shard_files(m["index"], n, config.formats, with_grids).values())
        if int(m["n_parts"]) != n or set(m["files"]) != want:
            raise InvalidConfigError(
                f"part {m['index']} wrote {sorted(m['files'])} as part of {m['n_parts']}; "
                f"an assembly of {n} parts needs {sorted(want)}"
            )
    return ordered


def assemble_metadata(
    ctx: RunContext, metas: Sequence[Mapping[str, Any]], annotate: Annotate | None = None
) -> Report:
    """The small files of the artifacts assembled from every part of the sharded checkpoint
    ctx.model, written into ctx.tmp (which must not exist): per format the shard index
    (weight map and total size), config.json and the tokenizer files, the native grids shard,
    and report.json. Returns the run's Report. `annotate(report, ctx.tmp)` (the caller's
    additions) runs before report.json is written, which happens once.

    Nothing of the parts' shards is read: `metas` is every part's part.json (in any order),
    whose "files" give each shard's size; the shards themselves go beside these files under
    the names part.json lists (assemble_parts moves them; a fanned-out job's parts wrote them
    where the artifact is published). The model's directory needs only config.json, the shard
    index and the tokenizer files. The report's metrics["parts"] lists each part (index,
    shards, seconds) and its `files` every file of each format, the parts' shards included."""
    rep = _assemble_small_files(ctx, metas)
    _finish_report(rep, ctx.tmp, annotate)
    report(ctx.progress, "packaging", 1, 1)
    return rep


def _finish_report(rep: Report, out_dir: Path, annotate: Annotate | None) -> None:
    """The caller's annotations, then report.json (the one write); `out_dir` goes on error."""
    try:
        if annotate is not None:
            annotate(rep, out_dir)
        rep.save(out_dir / "report.json")
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _assemble_small_files(ctx: RunContext, metas: Sequence[Mapping[str, Any]]) -> Report:
    """assemble_metadata's files but report.json; returns the report to write."""
    t0 = time.perf_counter()
    config = ctx.config
    ordered = check_parts(metas, config)
    report(ctx.progress, "packaging", 0, 1)
    specs, plans = _plans(ctx.model, config)
    grids = sorted({(int(p), int(q)) for m in ordered for p, q in m["grids"]})
    planned = sorted({(int(pl.grid[0]), int(pl.grid[1])) for pl in plans if pl.grid is not None})
    if grids != planned:
        raise CorruptCheckpointError(f"the parts used the grids {grids}, the plan has {planned}")
    ctx.tmp.mkdir(parents=True, exist_ok=False)
    try:
        files, grid_bytes = _write_small_files(ctx, ordered, grids)
        rows = {name: LayerReport(**row) for m in ordered for name, row in m["rows"].items()}
        missing = [s.name for s in specs if s.name not in rows]
        if missing:
            raise CorruptCheckpointError(f"no part holds the layers {missing[:5]}")
        written = Written(
            rows=rows,
            files=files,
            grid_bytes=grid_bytes,
            native_bytes=sum(int(m["native_bytes"]) for m in ordered) + grid_bytes,
            bytes_before=sum(int(m["bytes_before"]) for m in ordered),
            params_total=sum(int(m["params"]) for m in ordered),
            calibration=None,
        )
        ctx.timings["quantizing"] = ctx.timings.get(
            "quantizing", sum(float(m["seconds"]) for m in ordered)
        )
        ctx.timings["packaging"] = time.perf_counter() - t0
        rep = build_report(ctx, specs, plans, written)
        rep.metrics["parts"] = [
            {"index": m["index"], "shards": m["shards"], "seconds": m["seconds"]} for m in ordered
        ]
    except BaseException:
        shutil.rmtree(ctx.tmp, ignore_errors=True)
        raise
    return rep


def _write_small_files(
    ctx: RunContext, ordered: list[dict[str, Any]], grids: list[tuple[int, int]]
) -> tuple[dict[str, dict[str, int]], int]:
    """Per format: the shard index, the configs and tokenizer files, the native grids shard.
    Returns ({format: {file: bytes}}, the grids' bytes)."""
    from higgs_engine.formats.native import quantization_config

    config, n = ctx.config, len(ordered)
    files: dict[str, dict[str, int]] = {}
    grid_bytes = 0
    counts = shard_counts(n, config.formats, bool(grids))
    for fmt in config.formats:
        fmt_dir = ctx.tmp / fmt
        fmt_dir.mkdir()
        count = counts[fmt]
        weight_map: dict[str, str] = {}
        sizes: dict[str, int] = {}
        total_size = 0
        for i, m in enumerate(ordered):
            name = shard_name(i, count)
            weight_map.update(dict.fromkeys(m["tensors"][fmt]["names"], name))
            total_size += int(m["tensors"][fmt]["bytes"])
            sizes[name] = int(m["files"][f"{fmt}/{name}"]["bytes"])
        if count > n:
            grid_bytes, names = _write_grid_shard(fmt_dir / shard_name(n, count), grids)
            weight_map.update(dict.fromkeys(names, shard_name(n, count)))
            total_size += grid_bytes
        _write_index(fmt_dir, weight_map, total_size)
        layers = {k: v for m in ordered for k, v in m["layers"].items()}
        kept = [k for m in ordered for k in m["kept"]]
        qc = quantization_config(config.dtype, config.to_dict(), grids, layers, kept)
        format_writer(fmt).write_configs(fmt_dir, ctx.model.path, config.dtype, qc)
        sizes.update({p.name: p.stat().st_size for p in fmt_dir.iterdir()})
        files[fmt] = dict(sorted(sizes.items()))
    if not grid_bytes and grids:
        from higgs_engine.grids import get_grid

        grid_bytes = sum(get_grid(p, q).numel() * 4 for p, q in grids)
    return files, grid_bytes


def assemble_parts(
    ctx: RunContext,
    part_dirs: Sequence[Path],
    annotate: Annotate | None = None,
    move: bool = False,
) -> Report:
    """Assemble every part of a sharded checkpoint into ctx.tmp (which must not exist) and
    return the run's Report (also written as report.json there).

    The small files come as assemble_metadata's; each part's shards (in `part_dirs`, every
    part's output directory in any order) go beside them, moved with move=True (one rename
    each), else copied. Then `annotate(report, ctx.tmp)` (the artifacts complete) and the one
    write of report.json."""
    metas = [read_part(d) for d in part_dirs]
    where = {int(m["index"]): Path(d) for m, d in zip(metas, part_dirs, strict=True)}
    rep = _assemble_small_files(ctx, metas)
    try:
        for m in metas:
            for rel in sorted(m["files"]):
                _place(where[int(m["index"])] / rel, ctx.tmp / rel, move)
    except BaseException:
        shutil.rmtree(ctx.tmp, ignore_errors=True)
        raise
    _finish_report(rep, ctx.tmp, annotate)
    report(ctx.progress, "packaging", 1, 1)
    return rep


def _write_grid_shard(path: Path, grids: Sequence[tuple[int, int]]) -> tuple[int, list[str]]:
    """The native artifact's last shard: one float32 (n, p) tensor per grid any part used."""
    import torch

    from higgs_engine.formats.native import grid_key
    from higgs_engine.grids import get_grid

    writer = StreamingSafetensorsWriter(path, {"format": "pt"})
    names = []
    try:
        for p, n in grids:
            writer.add(grid_key(p, n), get_grid(p, n).to(torch.float32).contiguous())
            names.append(grid_key(p, n))
        nbytes = writer.nbytes
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return nbytes, names
