"""GGUF for llama.cpp: llama.cpp's own kernels and tools through the engine, on tiny real
checkpoints converted with llama.cpp's converter and run in llama.cpp."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from devtools.quality import data_ready
from higgs_engine.errors import InfeasibleTargetError, InvalidConfigError, UnsupportedModelError
from higgs_engine.gguf.convert import check_architecture, convert_checkpoint
from higgs_engine.gguf.evaluate import evaluate_encoder
from higgs_engine.gguf.llama import LlamaModel, quantize_rows, roundtrip_rows, type_traits
from higgs_engine.gguf.plan import (
    allocate_gguf,
    build_gguf_problem,
    context_length,
    measure_errors,
    read_gguf,
    relative_errors,
)
from higgs_engine.gguf.run import GgufEvalRequest, GgufRun, quantize_gguf
from higgs_engine.planning.allocator import allocate
from higgs_engine.planning.gguf_types import (
    GGUF_MENU,
    GGUF_TYPES,
    type_for_row,
    uniform_type_for_bits,
)
from higgs_engine.planning.plans import Target
from higgs_engine.planning.profile import ProfileConfig
from tests.fixtures import TINY_TEXT, build_gguf_llama

# a cheap data-free profile for the tiny models (random tokens, Fisher)
TINY_PROFILE = ProfileConfig(method="fisher", windows=2, context=32, data_free="random")


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gguf_llama(tmp_path_factory.mktemp("gguf") / "tiny256")


@pytest.fixture(scope="module")
def gguf_llama_f32(gguf_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf-f32") / "tiny-f32.gguf"
    return convert_checkpoint(gguf_llama, out, outtype="f32")


# ---------------------------------------------------------------------------------------------
# Types and kernels
# ---------------------------------------------------------------------------------------------


def test_type_table_matches_ggml() -> None:
    for t in GGUF_TYPES.values():
        name, block, size = type_traits(t.ggml_id)
        assert name.upper() == t.name
        assert (block, size) == (t.block, t.block_bytes)


def test_roundtrip_errors_fall_with_bits() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 512)).astype(np.float32)
    t2 = dict(zip([t.name for t in GGUF_MENU], relative_errors(w, GGUF_MENU), strict=True))
    chain = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]
    assert all(t2[a] > t2[b] for a, b in itertools.pairwise(chain))
    assert t2["F16"] == 0.0
    # Gaussian rows: Q4_K's relative error is a few 1e-3 (about 4.5 bits)
    assert 1e-3 < t2["Q4_K"] < 1e-2
    assert t2["Q8_0"] < 1e-4


def test_roundtrip_is_the_kernel_pair() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 256)).astype(np.float32)
    t = GGUF_TYPES["Q4_K"]
    data = quantize_rows(w, t)
    assert len(data) == 8 * t.row_bytes(256)
    again = roundtrip_rows(w, t)
    assert np.array_equal(again, roundtrip_rows(w, t))  # deterministic
    assert not np.array_equal(again, w)


def test_bad_widths_are_refused() -> None:
    with pytest.raises(InvalidConfigError, match="100 values"):
        quantize_rows(np.zeros((2, 100), np.float32), GGUF_TYPES["Q4_K"])
    assert type_for_row(GGUF_TYPES["Q4_K"], 576) == GGUF_TYPES["Q5_0"]
    assert type_for_row(GGUF_TYPES["Q4_K"], 1536) == GGUF_TYPES["Q4_K"]
    assert type_for_row(GGUF_TYPES["Q4_0"], 40) == GGUF_TYPES["F16"]
    assert uniform_type_for_bits(4.5) == GGUF_TYPES["Q4_K"]
    with pytest.raises(InvalidConfigError, match=r"bits=1\.5"):
        uniform_type_for_bits(1.5)
    assert uniform_type_for_bits(16) == GGUF_TYPES["F16"]
    with pytest.raises(InvalidConfigError, match=r"bits=100 is above the widest GGUF type"):
        uniform_type_for_bits(100)  # never silently F16


# ---------------------------------------------------------------------------------------------
# Converter and llama.cpp
# ---------------------------------------------------------------------------------------------


def test_shipped_architecture_list_is_the_converters() -> None:
    """The API checks gguf requests against a list shipped with the package (no llama.cpp in
    the API image): it must be the installed converter's."""
    from higgs_engine.gguf.convert import supported_architectures
    from higgs_engine.planning.gguf_types import GGUF_ARCHITECTURES

    assert supported_architectures() == GGUF_ARCHITECTURES


def test_converter_knows_the_families() -> None:
    assert check_architecture(["LlamaForCausalLM"]) == "LlamaForCausalLM"
    assert check_architecture(["BertModel"]) == "BertModel"
    with pytest.raises(UnsupportedModelError, match="FooForCausalLM"):
        check_architecture(["FooForCausalLM"])


def test_llama_cpp_runs_the_converted_model_like_torch(
    gguf_llama: Path, gguf_llama_f32: Path
) -> None:
    """The float32 GGUF in llama.cpp gives the torch model's logits (converter and runtime
    agree on the architecture, Q/K permutation and norms included)."""
    import torch
    from transformers import AutoModelForCausalLM

    tokens = [1, 17, 200, 45, 99, 3, 250, 8, 64, 300]
    model = AutoModelForCausalLM.from_pretrained(str(gguf_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].numpy()
    with LlamaModel(gguf_llama_f32, n_ctx=32) as m:
        got = m.logits(tokens)
    scale = float(np.abs(ref).max())
    assert np.abs(got - ref).max() < 2e-3 * scale


def test_context_length_is_llama_cpps_n_ctx_train(gguf_llama_f32: Path) -> None:
    """The metadata read (no model loaded) gives what llama.cpp reports once it loads the file."""
    with LlamaModel(gguf_llama_f32, n_ctx=8) as m:
        assert context_length(gguf_llama_f32) == m.n_ctx_train == 256


@pytest.mark.realdata
@pytest.mark.skipif(not data_ready()[0], reason=data_ready()[1])
def test_encoder_evaluation_fits_windows_to_the_learned_positions(tmp_path: Path) -> None:
    """all-MiniLM-L6-v2 (llama.cpp's converter does not take the tiny test encoder's
    tokenizer): its 512 learned positions bound the window, framing tokens included."""
    from devtools.quality import MINILM_DIR

    bert = convert_checkpoint(MINILM_DIR, tmp_path / "minilm.gguf")
    with LlamaModel(bert, n_ctx=8, embeddings=True) as m:
        assert context_length(bert) == m.n_ctx_train == 512
    res = evaluate_encoder(bert, bert, TINY_TEXT * 200, context=1000, windows=2)
    assert (res.context, res.windows) == (510, 2)
    assert res.one_minus_cos == pytest.approx(0.0, abs=1e-6)  # the same file on both sides


# Relative logit error against the float32 file on the tiny model, whose weights carry heavy
# cubed-Gaussian outliers (tests/fixtures.py); measured 0.063 / 0.30 / 0.47 (F16: 0.002).
@pytest.mark.parametrize(
    ("bits", "kind", "bound"),
    [
        (8.0, "Q8_0", 0.1),
        # slow: the K-quants take longer to write; the lane keeps Q8_0
        pytest.param(5.0, "Q5_K", 0.45, marks=pytest.mark.slow),
        pytest.param(4.0, "Q4_K", 0.7, marks=pytest.mark.slow),
    ],
)
def test_uniform_file_runs_in_llama_cpp(
    gguf_llama: Path, gguf_llama_f32: Path, tmp_path: Path, bits: float, kind: str, bound: float
) -> None:
    rep = quantize_gguf(GgufRun(gguf_llama, tmp_path / "out", bits=bits))
    files = sorted((tmp_path / "out" / "gguf").glob("*.gguf"))
    assert [p.name for p in files] == rep.metrics["gguf_files"]
    written = read_gguf(files, quantized=True)
    assert set(written.types.values()) == {kind}  # every row of 256 / 512 fits the K-quants
    # llama.cpp's own figure: tensor bytes over every parameter
    tensor_bytes = written.fixed_bytes + sum(written.bytes_of.values())
    assert rep.bits_per_weight == pytest.approx(8 * tensor_bytes / written.params_total)
    assert json.loads((tmp_path / "out" / "report.json").read_text())["formats"] == ["gguf"]
    tokens = [1, 17, 200, 45, 99, 3, 250, 8, 64, 300, 12, 13]
    with LlamaModel(gguf_llama_f32, n_ctx=32) as m0, LlamaModel(files[0], n_ctx=32) as m1:
        ref, got = m0.logits(tokens), m1.logits(tokens)
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel < bound
    if bits == 8.0:  # Q8_0 keeps the greedy choices
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8


# slow: a llama.cpp conversion and run per row width
@pytest.mark.slow
def test_fallback_types_for_narrow_rows(tmp_path: Path) -> None:
    ckpt = build_gguf_llama(tmp_path / "tiny96", hidden=96)
    rep = quantize_gguf(GgufRun(ckpt, tmp_path / "out", bits=4))
    # 96-value rows: no K-quant fits; llama.cpp's fallback for Q4_K is Q5_0
    assert rep.metrics["type_histogram"] == {"Q5_0": len(rep.layers)}


# slow: profile, allocation and a llama.cpp file (the lane keeps test_avg_bits_job_end_to_end)
@pytest.mark.slow
def test_dynamic_allocation_meets_the_budget_and_is_exact(gguf_llama: Path, tmp_path: Path) -> None:
    f16 = convert_checkpoint(gguf_llama, tmp_path / "f16.gguf")
    f = read_gguf(f16)
    t2 = measure_errors(f)
    rng = np.random.default_rng(0)
    alphas = rng.uniform(0.1, 2.0, len(f.tensors))
    problem = build_gguf_problem(f, alphas, t2)
    budgets = (3.5, 4.5, 6.0)
    preds = []
    for b in budgets:
        alloc = allocate_gguf(f, problem, avg_bits=b)
        assert alloc.file_bits_per_weight <= b + 1e-9
        preds.append(alloc.predicted)
    assert preds[0] > preds[1] > preds[2]
    # the DP against exhaustive search on the first 3 tensors (fixed cost of the rest aside)
    small = build_gguf_problem(
        type(f)(f.paths, f.arch, f.n_blocks, f.tensors[:3], 0, sum(t.numel for t in f.tensors[:3])),
        alphas[:3],
        t2[:3],
    )
    budget = 5.0 * small.total_numel
    best = min(
        math.fsum(small.error[i, j] for i, j in enumerate(ch))
        for ch in itertools.product(range(len(GGUF_MENU)), repeat=3)
        if sum(small.cost_bits[i, j] for i, j in enumerate(ch)) <= budget
    )
    got = allocate(small, 5.0, resolution=1e-6)
    assert got.total_bits <= budget
    assert got.predicted == pytest.approx(best, rel=1e-9)
    with pytest.raises(InfeasibleTargetError, match="avg_bits=1"):
        allocate_gguf(f, problem, avg_bits=1.0)


def test_avg_bits_job_end_to_end(gguf_llama: Path, tmp_path: Path) -> None:
    """Profile (embedding and head included) -> t^2 -> DP -> llama_model_quantize with one
    override per tensor -> the file holds exactly the allocated types; evaluation in llama.cpp
    gives perplexity and KL beside the prediction."""
    progress: list[tuple[str, int, int]] = []
    rep = quantize_gguf(
        GgufRun(
            gguf_llama,
            tmp_path / "out",
            target=Target(avg_bits=4.5),
            profile_config=TINY_PROFILE,
            evaluate=GgufEvalRequest(TINY_TEXT * 8, "tiny", context=32, windows=4),
            progress=lambda s, d, t: progress.append((s, d, t)),
        )
    )
    m = rep.metrics
    assert rep.bits_per_weight <= 4.5 + 1e-9
    names = {row.name for row in rep.layers}
    assert {"token_embd.weight", "output.weight"} <= names  # embeddings and head allocated
    assert all(row.alpha is not None and row.alpha >= 0 for row in rep.layers)
    assert len(m["type_histogram"]) >= 2  # a mixture, not one type
    files = sorted((tmp_path / "out" / "gguf").glob("*.gguf"))
    written = read_gguf(files, quantized=True)
    assert {r.name: r.type for r in rep.layers} == written.types
    assert m["predicted_change"] > 0 and m["kl"] >= 0
    assert m["ppl_quantized"] > 0 and m["ppl_base"] > 0
    stages = [s for s, _, _ in progress]
    for stage in ("converting", "profiling", "measuring", "allocating", "quantizing"):
        assert stage in stages
    assert ("measuring", len(rep.layers), len(rep.layers)) in progress


# slow: llama.cpp conversion, split and reload
@pytest.mark.slow
def test_split_files_load_as_one_model(gguf_llama: Path, tmp_path: Path) -> None:
    one = quantize_gguf(GgufRun(gguf_llama, tmp_path / "one", bits=8))
    split = quantize_gguf(GgufRun(gguf_llama, tmp_path / "split", bits=8, split_max_bytes=2**20))
    files = split.metrics["gguf_files"]
    assert len(files) >= 2 and files[0].endswith(f"-00001-of-{len(files):05d}.gguf")
    assert split.bits_per_weight == pytest.approx(one.bits_per_weight)
    tokens = [1, 5, 9, 33, 120, 7]
    with (
        LlamaModel(tmp_path / "one" / "gguf" / one.metrics["gguf_files"][0], n_ctx=16) as a,
        LlamaModel(tmp_path / "split" / "gguf" / files[0], n_ctx=16) as b,
    ):
        assert np.array_equal(a.logits(tokens), b.logits(tokens))


def test_bad_input_leaves_nothing(gguf_llama: Path, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "foo"
    shutil.copytree(gguf_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="FooForCausalLM"):
        quantize_gguf(GgufRun(bad, tmp_path / "out", bits=4))
    with pytest.raises(InfeasibleTargetError):
        quantize_gguf(
            GgufRun(
                gguf_llama,
                tmp_path / "out",
                target=Target(avg_bits=2.0),
                profile_config=TINY_PROFILE,
            )
        )
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["foo"]
    with pytest.raises(InvalidConfigError, match="exactly one"):
        GgufRun(gguf_llama, tmp_path / "out", bits=4, ftype="Q4_K_M")
