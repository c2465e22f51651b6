"""Every artifact loaded by its engine (higgs_engine.artifact_check): what a real run writes
loads (llama.cpp in a subprocess for gguf, the project's loader for native, transformers on
the meta device for dequantized), and a file damaged after the run fails as
corrupt_checkpoint naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from higgs_engine.artifact_check import verify_artifacts, verify_dequantized, verify_gguf
from higgs_engine.errors import CorruptCheckpointError
from higgs_engine.job import GgufOptions, QuantizeJob, run
from higgs_engine.planning.config import HiggsConfig
from tests.fixtures import build_gguf_llama
from tests.hostile_corpus import HIDDEN


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("artifacts")
    ckpt = build_gguf_llama(root / "tiny", hidden=HIDDEN)
    run(QuantizeJob(ckpt, HiggsConfig.from_bits(4)), root / "higgs")
    run(QuantizeJob(ckpt, gguf=GgufOptions(bits=4)), root / "g")
    return root


def test_what_a_run_writes_loads(outputs: Path) -> None:
    verify_artifacts(outputs / "higgs", ["native", "dequantized"])
    verify_artifacts(outputs / "g", ["gguf"])


def test_a_truncated_gguf_fails(outputs: Path, tmp_path: Path) -> None:
    (src,) = (outputs / "g" / "gguf").glob("*.gguf")
    d = tmp_path / "gguf"
    d.mkdir()
    raw = src.read_bytes()
    (d / src.name).write_bytes(raw[: len(raw) * 2 // 3])
    with pytest.raises(CorruptCheckpointError, match=r"llama\.cpp cannot load"):
        verify_gguf(d)


def test_a_dequantized_config_that_lies_fails(outputs: Path, tmp_path: Path) -> None:
    d = tmp_path / "dequantized"
    shutil.copytree(outputs / "higgs" / "dequantized", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 4 * HIDDEN
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptCheckpointError, match="intermediate_size"):
        verify_dequantized(d)


def test_a_native_artifact_missing_a_layer_fails(outputs: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(outputs / "higgs" / "native", out / "native")
    cfg_file = out / "native" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    layers = cfg["quantization_config"]["layers"]
    layers["model.layers.9.mlp.up_proj"] = next(iter(layers.values()))
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(CorruptCheckpointError, match="native artifact"):
        verify_artifacts(out, ["native"])
