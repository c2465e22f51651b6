"""The two registries: artifact formats (higgs_engine.formats.FORMATS) and quantization methods
(higgs_engine.methods.METHODS).

- the registered format names are the names HiggsConfig accepts;
- native and dequantized artifacts are byte-identical to a reference written here from the
  primitives (quantize_matrix_full, dequantize_matrix, the streaming safetensors writer);
- a toy format and a toy method, registered by this test only, run through the real
  ArtifactWriter and run core: one class and one registry entry are all they need;
- every registered method equals the function it wraps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from safetensors import safe_open

from higgs_engine.artifacts import ArtifactWriter
from higgs_engine.baselines import nf4_quantize, rtn_quantize
from higgs_engine.errors import InvalidConfigError
from higgs_engine.formats import FORMATS, FormatWriter, format_writer
from higgs_engine.formats.native import grid_key, quantization_config
from higgs_engine.gptq import gptq_higgs_many, gptq_rtn
from higgs_engine.grids import get_grid
from higgs_engine.methods import (
    METHODS,
    CalibratedMethod,
    DataFreeMethod,
    Precision,
    Quantized,
    method,
)
from higgs_engine.model_structure import LayerSpec, load_config, scope_specs
from higgs_engine.parts import shard_counts
from higgs_engine.pipeline import quantize_checkpoint
from higgs_engine.planning import config as planning_config
from higgs_engine.planning.config import HiggsConfig, MatrixSpec
from higgs_engine.quantize import QuantizedMatrix, dequantize_matrix, quantize_matrix_full
from higgs_engine.run_core import LayerPlan, RunContext, plan_layers, stream_tensors
from higgs_engine.safetensors_stream import CheckpointReader, StreamingSafetensorsWriter
from higgs_engine.sources import resolve_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = HiggsConfig(p=2, n=256, sign_seed=5)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _plans(ckpt: Path, reader: CheckpointReader, config: HiggsConfig) -> list[LayerPlan]:
    return plan_layers(scope_specs(load_config(ckpt), reader.keys(), config.scope), config)


def _context(ckpt: Path, out: Path, config: HiggsConfig, method_name: str) -> RunContext:
    return RunContext(
        model=resolve_model(ckpt),
        tmp=out,
        config=config,
        progress=None,
        device=torch.device("cpu"),
        method=method_name,
    )


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------


def test_registered_formats_are_the_names_the_config_accepts() -> None:
    assert sorted(FORMATS) == sorted(planning_config.WRITER_FORMATS)  # every name has its writer
    assert all(cls.name == name for name, cls in FORMATS.items())
    HiggsConfig(formats=tuple(FORMATS))
    with pytest.raises(InvalidConfigError, match="toy"):
        HiggsConfig(formats=("toy",))
    with pytest.raises(InvalidConfigError, match="'toy'") as exc:
        format_writer("toy")
    assert exc.value.field == "formats"


def test_every_list_of_format_names_derives_from_the_one_definition() -> None:
    """The API's options.formats, the CLI's --format and the registry all take their names
    from planning.config's Literals: what they offer is exactly FORMAT_NAMES."""
    from app.jobs.schemas import Options
    from higgs_cli.common import CliError
    from higgs_cli.engine_cmds import check_formats

    names = planning_config.FORMAT_NAMES
    assert names == planning_config.WRITER_FORMATS + planning_config.WHOLE_FILE_FORMATS
    assert set(planning_config.DEFAULT_FORMATS) <= set(planning_config.WRITER_FORMATS)
    prop = Options.model_json_schema()["properties"]["formats"]
    assert prop["items"]["enum"] == list(names) and prop["maxItems"] == len(names)
    assert Options().formats == list(planning_config.DEFAULT_FORMATS)
    check_formats(" , ".join(names))  # every name, as the CLI splits them
    with pytest.raises(CliError, match=", ".join(names)):
        check_formats("native,toy")


def test_no_shipped_module_spells_out_a_list_of_format_names() -> None:
    """Outside planning/config.py no tuple, list or set of the shipped packages holds two or
    more format names: a format added there reaches every list by itself."""
    import ast

    root = Path(__file__).resolve().parents[2]
    names = set(planning_config.FORMAT_NAMES)
    home = root / "higgs_engine" / "planning" / "config.py"
    found = []
    for pkg in ("higgs_engine", "app", "worker", "higgs_cli"):
        for path in sorted((root / pkg).rglob("*.py")):
            if path == home:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Tuple | ast.List | ast.Set):
                    continue
                elts = node.elts
                hits = [e.value for e in elts if isinstance(e, ast.Constant) and e.value in names]
                if len(hits) >= 2:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {hits}")
    assert not found, found


def test_registered_methods_are_named_by_their_keys() -> None:
    assert set(METHODS) >= {"higgs", "higgs-gptq", "rtn", "nf4", "gptq-int4"}
    assert all(m.name == name for name, m in METHODS.items())
    assert {n for n, m in METHODS.items() if m.needs_calibration} == {"higgs-gptq", "gptq-int4"}
    assert {n for n, m in METHODS.items() if m.native} == {"higgs", "higgs-gptq"}
    with pytest.raises(InvalidConfigError, match="'toy'"):
        method("toy")


# ---------------------------------------------------------------------------------------------
# native / dequantized against a reference written from the primitives
# ---------------------------------------------------------------------------------------------


def _reference(ckpt: Path, out: Path, config: HiggsConfig) -> dict[str, Any]:
    """The native and dequantized weight files written here without the ArtifactWriter, and
    the native quantization_config; returns that config."""
    dtype = {"float16": torch.float16, "float32": torch.float32}[config.dtype]
    out.mkdir()
    native = StreamingSafetensorsWriter(out / "native.safetensors", {"format": "pt"})
    deq = StreamingSafetensorsWriter(out / "dequantized.safetensors", {"format": "pt"})
    layers: dict[str, dict[str, Any]] = {}
    kept: list[str] = []
    grids: set[tuple[int, int]] = set()
    with CheckpointReader(ckpt) as reader:
        by_key = {pl.spec.key: pl for pl in _plans(ckpt, reader, config)}
        for key in reader:
            pl = by_key.get(key)
            if pl is None or pl.grid is None:
                t = reader.get(key)
                t = t.to(dtype) if t.is_floating_point() else t
                native.add(key, t)
                deq.add(key, t)
                if pl is not None:
                    kept.append(pl.spec.name)
                continue
            spec = pl.spec
            q, w_hat = quantize_matrix_full(
                spec.weight(reader),
                MatrixSpec(
                    *pl.grid,
                    group_size=config.group_size,
                    rotation_block=config.rotation_block,
                    sign_seed=config.sign_seed,
                    scale_rule=config.scale_rule,
                ),
            )
            assert w_hat is not None
            native.add(f"{spec.name}.higgs.codes", q.codes)
            native.add(f"{spec.name}.higgs.scales", q.scales)
            if pl.grid not in grids:
                grids.add(pl.grid)
                native.add(grid_key(*pl.grid), get_grid(*pl.grid).float())
            w = w_hat.t() if spec.transposed else w_hat
            deq.add(key, w.contiguous().to(dtype))
            layers[spec.name] = {
                **q.meta(),
                "weight_key": spec.key,
                "bias_key": spec.bias_key,
                "transposed": spec.transposed,
            }
    native.close()
    deq.close()
    return quantization_config(config.dtype, config.to_dict(), grids, layers, kept)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_native_and_dequantized_are_byte_identical_to_the_reference(
    kind: str, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = tiny_checkpoints[kind]
    quantize_checkpoint(ckpt, tmp_path / "out", CFG)
    qc = _reference(ckpt, tmp_path / "ref", CFG)
    for fmt in ("native", "dequantized"):
        got = (tmp_path / "out" / fmt / "model.safetensors").read_bytes()
        assert got == (tmp_path / "ref" / f"{fmt}.safetensors").read_bytes(), fmt
        cfg = json.loads((tmp_path / "out" / fmt / "config.json").read_text())
        source = json.loads((ckpt / "config.json").read_text())
        assert cfg.pop("quantization_config", None) == (qc if fmt == "native" else None)
        dtypes = {k: "float16" for k in ("dtype", "torch_dtype") if k in source or k == "dtype"}
        assert cfg == {**source, **dtypes}
        assert (tmp_path / "out" / fmt / "tokenizer.json").read_bytes() == (
            ckpt / "tokenizer.json"
        ).read_bytes()


# ---------------------------------------------------------------------------------------------
# A toy format: one class, one registry entry
# ---------------------------------------------------------------------------------------------


class Float32Writer(FormatWriter):
    """W_hat in float32 whatever the run's dtype; a config.json of its own."""

    name: ClassVar[str] = "float32"

    @classmethod
    def write_configs(
        cls, fmt_dir: Path, source_dir: Path, dtype: str, quant_config: dict[str, Any]
    ) -> None:
        layers = sorted(quant_config["layers"])
        (fmt_dir / "config.json").write_text(json.dumps({"toy": True, "layers": layers}))

    def add_quantized(
        self, spec: LayerSpec, q: QuantizedMatrix | None, w_hat: torch.Tensor
    ) -> None:
        self.add_plain(spec.key, w_hat.float().contiguous())


class GridCarrier(Float32Writer):
    name: ClassVar[str] = "carrier"
    carries_grids: ClassVar[bool] = True


def test_a_registered_toy_format_runs_through_the_writer(
    llama_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(FORMATS, "float32", Float32Writer)
    quantize_checkpoint(llama_ckpt, tmp_path / "plain", CFG)
    out = tmp_path / "toy"
    out.mkdir()
    formats = ("native", "float32", "dequantized")
    writer = ArtifactWriter(out, formats, CFG.dtype, llama_ckpt, CFG.to_dict())
    with CheckpointReader(llama_ckpt) as reader:
        plans = _plans(llama_ckpt, reader, CFG)
        todo = [pl for pl in plans if pl.grid is not None]
        stream_tensors(_context(llama_ckpt, out, CFG, "higgs"), reader, plans, writer, {}, 9)
        files = writer.finish()
        source = {k: reader.get(k) for k in reader}
    assert set(files) == set(formats)
    # the other formats are unchanged by a third one beside them
    for fmt in ("native", "dequantized"):
        for name in ("model.safetensors", "config.json"):
            assert (out / fmt / name).read_bytes() == (tmp_path / "plain" / fmt / name).read_bytes()
    toy = _tensors(out / "float32" / "model.safetensors")
    native = _tensors(out / "native" / "model.safetensors")
    qc = json.loads((out / "native" / "config.json").read_text())["quantization_config"]
    assert set(toy) == set(source) and todo
    for pl in todo:
        meta = {k: v for k, v in qc["layers"][pl.spec.name].items() if "key" not in k}
        meta.pop("transposed")
        prefix = f"{pl.spec.name}.higgs."
        q = QuantizedMatrix.from_tensors(
            {k[len(prefix) :]: t for k, t in native.items() if k.startswith(prefix)}, meta
        )
        assert toy[pl.spec.key].dtype == torch.float32
        assert torch.equal(toy[pl.spec.key], dequantize_matrix(q))
    plain = [k for k in source if k not in {pl.spec.key for pl in todo}]
    assert all(torch.equal(toy[k], source[k].half()) for k in plain)
    toy_cfg = json.loads((out / "float32" / "config.json").read_text())
    assert toy_cfg == {"toy": True, "layers": sorted(qc["layers"])}


def test_shard_counts_ask_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FORMATS, "float32", Float32Writer)
    monkeypatch.setitem(FORMATS, "carrier", GridCarrier)
    got = shard_counts(3, ["native", "dequantized", "float32", "carrier"], True)
    assert got == {"native": 4, "dequantized": 3, "float32": 3, "carrier": 4}
    assert shard_counts(3, ["native", "carrier"], False) == {"native": 3, "carrier": 3}
    with pytest.raises(InvalidConfigError, match="'nope'"):
        shard_counts(3, ["nope"], True)


# ---------------------------------------------------------------------------------------------
# A toy method: one class, one registry entry
# ---------------------------------------------------------------------------------------------


class SignMethod(DataFreeMethod):
    """1-bit: sign(W) times each row's mean |W| (no native encoding)."""

    name: ClassVar[str] = "sign"

    def quantize(
        self,
        w: torch.Tensor,
        precision: Precision,
        config: HiggsConfig | None = None,
        *,
        hessian: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> Quantized:
        w_hat = torch.sign(w) * w.abs().mean(1, keepdim=True)
        return Quantized(w_hat, 1.0 + 16.0 / w.shape[1])


def test_a_registered_toy_method_runs_through_the_run_core(
    llama_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(METHODS, "sign", SignMethod())
    config = HiggsConfig(p=2, n=256, formats=("dequantized",), dtype="float32")
    out = tmp_path / "sign"
    out.mkdir()
    writer = ArtifactWriter(out, config.formats, config.dtype, llama_ckpt, config.to_dict())
    with CheckpointReader(llama_ckpt) as reader:
        plans = _plans(llama_ckpt, reader, config)
        ctx = _context(llama_ckpt, out, config, "sign")
        rows = stream_tensors(ctx, reader, plans, writer, {}, 9)
        writer.finish()
        got = _tensors(out / "dequantized" / "model.safetensors")
        for pl in plans:
            assert pl.grid is not None
            w = pl.spec.weight(reader)
            assert torch.equal(got[pl.spec.key], SignMethod().quantize(w, Precision()).w_hat)
            row = rows[pl.spec.name]
            assert row.bits == 1.0 + 16.0 / pl.spec.in_features
            assert row.bytes == math.ceil(row.bits * pl.spec.numel / 8)
    # no native encoding: the native format refuses it, naming the layer
    writer = ArtifactWriter(tmp_path / "n", ("native",), "float16", llama_ckpt, config.to_dict())
    with CheckpointReader(llama_ckpt) as reader, pytest.raises(InvalidConfigError, match="layer"):
        stream_tensors(ctx, reader, plans, writer, {}, 9)
    writer.abort()


# ---------------------------------------------------------------------------------------------
# Every registered method equals the function it wraps
# ---------------------------------------------------------------------------------------------


def _w(rows: int = 48, cols: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) + 0.1 * torch.randn(rows, cols, generator=g) ** 3


def _hessian(cols: int = 256, seed: int = 1) -> torch.Tensor:
    x = torch.randn(512, cols, generator=torch.Generator().manual_seed(seed))
    return 2 * x.T @ x / 512


def _same_q(a: QuantizedMatrix | None, b: QuantizedMatrix) -> bool:
    assert a is not None
    ta, tb = a.to_tensors(), b.to_tensors()
    return a.meta() == b.meta() and all(torch.equal(ta[k], tb[k]) for k in tb)


def test_higgs_equals_quantize_matrix_full() -> None:
    w = _w()
    cfg = HiggsConfig(p=2, n=64, group_size=64, rotation_block=128, sign_seed=3)
    res = METHODS["higgs"].quantize(w, Precision(grid=(1, 16)), cfg)
    q, w_hat = quantize_matrix_full(
        w,
        MatrixSpec(
            1, 16, group_size=64, rotation_block=128, sign_seed=3, scale_rule=cfg.scale_rule
        ),
    )  # the grid from the target, the rest from the config
    assert w_hat is not None
    assert _same_q(res.quantized, q) and torch.equal(res.w_hat, w_hat)
    assert res.bits == q.bits_per_weight()
    default = METHODS["higgs"].quantize(w, Precision(), cfg)  # no grid: the config's
    assert default.quantized is not None and (default.quantized.p, default.quantized.n) == (2, 64)
    with pytest.raises(InvalidConfigError, match="HiggsConfig"):
        METHODS["higgs"].quantize(w, Precision())


def test_higgs_gptq_equals_gptq_higgs_many() -> None:
    ws, h = [_w(32), _w(16, seed=2)], _hessian()
    cfg = HiggsConfig(p=2, n=256, group_size=128, rotation_block=256)
    res = METHODS["higgs-gptq"].quantize_many(ws, Precision(grid=(2, 256)), cfg, hessian=h)
    ref = gptq_higgs_many(
        ws,
        h,
        MatrixSpec(
            2,
            256,
            group_size=128,
            rotation_block=256,
            sign_seed=cfg.sign_seed,
            scale_rule=cfg.scale_rule,
        ),
    )  # as calibrate_layers called it
    assert len(res) == 2
    for r, (q, w_hat) in zip(res, ref, strict=True):
        assert _same_q(r.quantized, q) and torch.equal(r.w_hat, w_hat)
    one = METHODS["higgs-gptq"].quantize(ws[0], Precision(), cfg, hessian=h)
    q1, w1 = gptq_higgs_many(
        ws[:1],
        h,
        MatrixSpec(
            2,
            256,
            group_size=128,
            rotation_block=256,
            sign_seed=cfg.sign_seed,
            scale_rule=cfg.scale_rule,
        ),
    )[0]
    assert _same_q(one.quantized, q1) and torch.equal(one.w_hat, w1)
    with pytest.raises(InvalidConfigError, match="calibration"):
        METHODS["higgs-gptq"].quantize(ws[0], Precision(), cfg)


@pytest.mark.parametrize("bits", [3, 4])
def test_rtn_equals_rtn_quantize(bits: int) -> None:
    w = _w(16, 200)  # a short last group
    res = METHODS["rtn"].quantize(w, Precision(bits=bits, group_size=64))
    w_hat, bpw = rtn_quantize(w, bits, 64)
    assert torch.equal(res.w_hat, w_hat) and res.bits == bpw and res.quantized is None
    res = METHODS["rtn"].quantize(w, Precision(bits=bits))
    assert torch.equal(res.w_hat, rtn_quantize(w, bits)[0])
    # a grid of whole code bits gives the width: (1, 16) and (2, 256) are 4 bits
    for grid in [(1, 16), (2, 256)]:
        assert torch.equal(
            METHODS["rtn"].quantize(w, Precision(grid=grid)).w_hat, rtn_quantize(w, 4)[0]
        )
    with pytest.raises(InvalidConfigError, match="integer bit width"):
        METHODS["rtn"].quantize(w, Precision(grid=(2, 32)))


@pytest.mark.parametrize(("name", "dq"), [("nf4", False), ("nf4-dq", True)])
def test_nf4_equals_nf4_quantize(name: str, dq: bool) -> None:
    w = _w(24, 100)
    for block in (None, 32):
        res = METHODS[name].quantize(w, Precision(group_size=block))
        w_hat, bpw = nf4_quantize(w, block or 64, double_quant=dq)
        assert torch.equal(res.w_hat, w_hat) and res.bits == bpw
    with pytest.raises(InvalidConfigError, match="bits=3"):
        METHODS[name].quantize(w, Precision(bits=3))


def test_gptq_int4_equals_gptq_rtn() -> None:
    ws, h = [_w(32), _w(16, seed=2)], _hessian()
    res = METHODS["gptq-int4"].quantize_many(ws, Precision(group_size=128), hessian=h)
    w_hat, bits = gptq_rtn(torch.cat(ws, 0), h, 4, 128)
    assert torch.equal(torch.cat([r.w_hat for r in res], 0), w_hat)
    assert [r.w_hat.shape[0] for r in res] == [32, 16] and {r.bits for r in res} == {bits}
    one = METHODS["gptq-int4"].quantize(ws[0], Precision(bits=4), hessian=h)
    assert torch.equal(one.w_hat, gptq_rtn(ws[0], h)[0])
    with pytest.raises(InvalidConfigError, match="calibration"):
        METHODS["gptq-int4"].quantize(ws[0], Precision())
    assert isinstance(METHODS["gptq-int4"], CalibratedMethod)


def test_the_methods_a_config_offers_are_registered_and_checked() -> None:
    """HiggsConfig.method names a METHODS entry; what each needs (calibration, HIGGS codes)
    agrees with the registered Method; a config refuses what its method cannot write."""
    for name in planning_config.METHOD_NAMES:
        m = METHODS[name]
        assert m.native == (name in planning_config.HIGGS_METHODS), name
        assert m.needs_calibration == (name in planning_config.CALIBRATED_METHODS), name
    with pytest.raises(InvalidConfigError, match="'toy'") as exc:
        HiggsConfig(method="toy")
    assert exc.value.field == "method"
    with pytest.raises(InvalidConfigError, match="native") as exc:
        HiggsConfig(method="rtn")  # the default formats include native
    assert exc.value.field == "method"
    cfg = HiggsConfig(method="rtn", formats=("dequantized",), p=2, n=64)
    assert HiggsConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["method"] == "rtn"
    assert "method" not in HiggsConfig().to_dict()
    assert HiggsConfig(method="higgs-gptq").data_free_method == "higgs"
    for kw, needle in (
        ({"calibrated": False, "dynamic": False, "gguf": False}, "calibration"),
        ({"calibrated": True, "dynamic": True, "gguf": False}, None),
    ):
        if needle is None:
            planning_config.check_method_job("higgs-gptq", **kw)
            continue
        with pytest.raises(InvalidConfigError, match=needle):
            planning_config.check_method_job("higgs-gptq", **kw)
    with pytest.raises(InvalidConfigError, match="dynamic target"):
        planning_config.check_method_job("nf4", calibrated=False, dynamic=True, gguf=False)
