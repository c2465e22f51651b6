"""A GGUF run planned as data (higgs_engine.gguf.runplan) and run as planned
(higgs_engine.gguf.run.run_gguf_plan): validation naming the field, JSON, the rotation's two
candidates and their pick, an allocated plan re-run without the allocator, and the job's device
and threads reaching the profile, the measuring, the quantizer and the evaluation."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from higgs_engine.errors import InvalidConfigError
from higgs_engine.gguf.runplan import (
    GGUF_PLAN_VERSION,
    GgufChoices,
    GgufCompute,
    GgufEvalRequest,
    GgufGoal,
    GgufLayout,
    GgufModel,
    GgufPlan,
    GgufRotation,
    available_threads,
    pick_rotation,
    rotation_candidates,
)
from higgs_engine.planning.gguf_types import DEFAULT_SPLIT_BYTES, GGUF_MENU, GIB
from higgs_engine.planning.plans import Target
from higgs_engine.sources import ResolvedSource
from tests.engine.test_gguf import TINY_PROFILE, quantize, tiny_plan
from tests.fixtures import TINY_TEXT, build_gguf_llama

LLAMA = GgufModel("LlamaForCausalLM", "llama", encoder=False, rotatable=True)
SOURCE = ResolvedSource(Path("/models/tiny"), "tiny", None, "local")


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gguf_llama(tmp_path_factory.mktemp("gguf-plan") / "tiny256")


def _plan(**kw: Any) -> GgufPlan:
    base: dict[str, Any] = {
        "source": SOURCE,
        "model": LLAMA,
        "goal": GgufGoal(target=Target(avg_bits=4.5)),
        "profile": TINY_PROFILE,
    }
    return GgufPlan(**{**base, **kw})


def _sha(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.gguf")}


# ---------------------------------------------------------------------------------------------
# The plan as data
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: GgufGoal(ftype="Q9_Z"), "ftype"),
        (lambda: GgufGoal(bits=1.0), "bits"),
        (lambda: GgufLayout(split_max_bytes=1000), "split_max_bytes"),
        (lambda: GgufLayout(sample_values=0), "sample_values"),
        (lambda: GgufLayout(menu=()), "menu"),
        (lambda: GgufCompute(threads=-1), "threads"),
        (lambda: GgufRotation("sideways"), "rotate"),
        (lambda: GgufEvalRequest("text", windows=0), "windows"),
        (lambda: GgufChoices({"blk.0.attn_q.weight": "Q9_Z"}, None, 1), "types"),
        (lambda: _plan(profile=None), "profile"),
        (
            lambda: _plan(goal=GgufGoal(bits=4), rotation=GgufRotation("auto", rotated=None)),
            "rotate",
        ),
        (
            lambda: _plan(
                model=GgufModel("BertModel", "bert", encoder=True, rotatable=False),
                rotation=GgufRotation("on", rotated=True),
            ),
            "rotate",
        ),
        (
            lambda: _plan(goal=GgufGoal(ftype="Q4_K_M"), profile=None).with_choices(
                GgufChoices({}, None, 0)
            ),
            "choices",
        ),
    ],
)
def test_a_plan_that_cannot_run_fails_naming_its_field(build: Any, field: str) -> None:
    with pytest.raises(InvalidConfigError) as e:
        build()
    assert e.value.field == field


def test_exactly_one_goal() -> None:
    with pytest.raises(InvalidConfigError, match="exactly one"):
        GgufGoal(bits=4, ftype="Q4_K_M")
    assert GgufGoal(bits=4).label == "Q4_K"
    assert GgufGoal(ftype="Q4_K_M").label == "Q4_K_M"
    assert GgufGoal(target=Target(avg_bits=5.5)).label == "higgs-5.5bpw"
    assert GgufGoal(target=Target(max_ppl_increase=0.05)).label == "higgs-ppl0.05"


def test_the_plan_round_trips_through_json() -> None:
    plan = _plan(
        rotation=GgufRotation("auto", seed=3, rotated=True),
        layout=GgufLayout(GGUF_MENU[:4], 4096, 2 * GIB),
        compute=GgufCompute("cuda:1", 5),
        evaluate=GgufEvalRequest(TINY_TEXT, "tiny", context=32, windows=2),
    ).with_choices(GgufChoices({"blk.0.attn_q.weight": "Q4_K"}, 0.25, 1234, None))
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["version"] == GGUF_PLAN_VERSION
    assert GgufPlan.from_dict(d) == plan
    with pytest.raises(InvalidConfigError) as e:
        GgufPlan.from_dict({**d, "version": GGUF_PLAN_VERSION + 1})
    assert e.value.field == "version"
    assert GgufLayout().split_max_bytes == DEFAULT_SPLIT_BYTES == 8 * 1024**3


def test_rotation_auto_is_two_candidates_and_a_pick() -> None:
    open_plan = _plan(rotation=GgufRotation("auto", rotated=None))
    plain, rotated = rotation_candidates(open_plan)
    assert (plain.rotated, rotated.rotated) == (False, True)
    decided = _plan(rotation=GgufRotation("on", rotated=True))
    assert rotation_candidates(decided) == (decided,)

    def allocated(p: GgufPlan, predicted: float, nbytes: int) -> GgufPlan:
        return p.with_choices(GgufChoices({}, predicted, nbytes))

    # avg_bits: the lower prediction; the unrotated one on a tie or when rotated is infeasible
    assert pick_rotation(allocated(plain, 0.2, 10), allocated(rotated, 0.1, 11)).rotated
    assert not pick_rotation(allocated(plain, 0.1, 10), allocated(rotated, 0.1, 9)).rotated
    assert not pick_rotation(allocated(plain, 0.2, 10), None).rotated
    # max_ppl_increase: the smaller file
    bound = Target(max_ppl_increase=0.05)
    p2, r2 = rotation_candidates(_plan(goal=GgufGoal(target=bound), rotation=open_plan.rotation))
    assert pick_rotation(allocated(p2, 0.1, 10), allocated(r2, 0.2, 9)).rotated
    assert not pick_rotation(allocated(p2, 0.2, 10), allocated(r2, 0.1, 11)).rotated


def test_plan_gguf_reads_the_model_and_decides_what_it_can(gguf_llama: Path) -> None:
    auto = tiny_plan(gguf_llama, target=Target(avg_bits=5.0), rotate="auto")
    assert auto.model == LLAMA
    assert auto.rotation.rotated is None  # open: two candidates to compare
    assert auto.compute.threads == available_threads()  # 0 became every core
    # without a planning target there is nothing to compare, and no profile
    bits = tiny_plan(gguf_llama, bits=8, rotate="auto")
    assert bits.rotation.rotated is False and bits.profile is None
    assert tiny_plan(gguf_llama, bits=8, rotate="on").rotated


# ---------------------------------------------------------------------------------------------
# Running a plan
# ---------------------------------------------------------------------------------------------


def test_an_allocated_plan_runs_again_without_the_allocator(
    gguf_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan told to on_plan (its choices made) goes through JSON and runs again: the same
    file, byte for byte, and the allocator is not called."""
    from higgs_engine.gguf import run as gguf_run
    from higgs_engine.gguf.run import GgufContext, run_gguf_plan

    kept: list[GgufPlan] = []
    first = quantize(
        gguf_llama,
        tmp_path / "a",
        context=GgufContext(on_plan=kept.append),
        target=Target(avg_bits=4.5),
    )
    (plan,) = kept
    assert plan.choices is not None
    assert dict(plan.choices.types) == {row.name: row.type for row in first.layers}
    again = GgufPlan.from_dict(json.loads(json.dumps(plan.to_dict())))

    def no_allocator(*a: Any, **kw: Any) -> Any:
        raise AssertionError("an allocated plan is quantized with its own choices")

    monkeypatch.setattr(gguf_run, "allocate_gguf", no_allocator)
    second = run_gguf_plan(again, tmp_path / "b")
    assert _sha(tmp_path / "a" / "gguf") == _sha(tmp_path / "b" / "gguf")
    assert second.metrics["predicted_change"] == first.metrics["predicted_change"]


def test_device_and_threads_reach_profile_measure_quantize_and_evaluate(
    gguf_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF job's device and threads, through job.run, reach every call that uses them (the
    real calls, watched)."""
    from higgs_engine import dynamic
    from higgs_engine.gguf import evaluate as gguf_evaluate
    from higgs_engine.gguf import run as gguf_run
    from higgs_engine.job import GgufOptions, ProfileSource, QuantizeJob, run

    seen: dict[str, list[Any]] = {}

    def watch(module: Any, name: str, key: str) -> None:
        real = getattr(module, name)

        def call(*a: Any, **kw: Any) -> Any:
            seen.setdefault(name, []).append(kw.get(key))
            return real(*a, **kw)

        monkeypatch.setattr(module, name, call)

    watch(dynamic, "obtain_profile", "device")
    watch(gguf_run, "measure_errors", "threads")
    watch(gguf_run, "quantize_file", "threads")
    watch(gguf_evaluate, "evaluate_causal", "threads")
    job = QuantizeJob(
        gguf_llama,
        target=Target(avg_bits=5.0),
        profile=ProfileSource(config=TINY_PROFILE),
        device="cpu",
        gguf=GgufOptions(
            threads=3, evaluate=GgufEvalRequest(TINY_TEXT * 4, "tiny", context=32, windows=2)
        ),
    )
    run(job, tmp_path / "out")
    assert seen == {
        "obtain_profile": ["cpu"],
        "measure_errors": [3],
        "quantize_file": [3],
        "evaluate_causal": [3],
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_gguf_jobs_profile_runs_on_the_jobs_device(
    gguf_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU machine the profile of a GGUF job (self-generated text and Fisher passes) runs
    on the job's device, not the CPU."""
    from higgs_engine import dynamic, profile
    from higgs_engine.job import GgufOptions, ProfileSource, QuantizeJob, run

    devices: list[str] = []
    real = profile.compute_profile

    def watched(model: torch.nn.Module, *a: Any, **kw: Any) -> Any:
        devices.append(next(model.parameters()).device.type)
        return real(model, *a, **kw)

    monkeypatch.setattr(dynamic, "compute_profile", watched)
    job = QuantizeJob(
        gguf_llama,
        target=Target(avg_bits=5.0),
        profile=ProfileSource(config=TINY_PROFILE),
        device="cuda",
        gguf=GgufOptions(),
    )
    rep = run(job, tmp_path / "out")
    assert devices == ["cuda"]
    assert rep.metrics["predicted_change"] > 0
