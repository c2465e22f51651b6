"""compressed-tensors as a kind of the one JobPlan: `run(QuantizeJob(..., ct=CtOptions(...)))`
plans each layer's scheme as data, writes the checkpoint, has transformers load it before
success, and reports every layer; a dynamic target allocates over vLLM's menu from the profile;
bad plans and impossible budgets fail naming the field, leaving nothing behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from higgs_engine.ct.schemes import ct_scheme
from higgs_engine.errors import InfeasibleTargetError, InvalidConfigError
from higgs_engine.job import CtOptions, JobPlan, ProfileSource, QuantizeJob, plan, run
from higgs_engine.planning.plans import Target
from higgs_engine.planning.profile import Profile
from tests.fixtures import build_tiny_checkpoint, build_tiny_encoder, measure_tiny_profile


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("ctjob") / "llama")


@pytest.fixture(scope="module")
def tiny_profile(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Profile:
    path = measure_tiny_profile(tiny, tmp_path_factory.mktemp("ctprof") / "profile.json")
    return Profile.from_dict(json.loads(path.read_text()))


def allocated(source: Path, profile: Profile, avg_bits: float) -> QuantizeJob:
    """A compressed-tensors job whose schemes the allocator picks for `avg_bits`."""
    return QuantizeJob(
        source,
        target=Target(avg_bits=avg_bits),
        profile=ProfileSource(profile=profile),
        ct=CtOptions(),
    )


def test_bits_4_is_a_plan_of_schemes_and_a_checkpoint_transformers_loads(
    tiny: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    planned: list[JobPlan] = []
    job = QuantizeJob(tiny, ct=CtOptions(bits=4), on_plan=planned.append)
    rep = run(job, tmp_path / "out")
    (p,) = planned
    assert p.kind == "compressed-tensors" and p.ct is not None
    assert JobPlan.from_dict(json.loads(json.dumps(p.to_dict()))) == p  # stored as it is
    # down_proj reads the 96-wide intermediate: group 32; every other layer group 64
    assert set(p.ct["schemes"].values()) == {"w4a16-g32", "w4a16-g64"}
    out = tmp_path / "out"
    assert sorted(x.name for x in out.iterdir()) == ["compressed-tensors", "report.json"]
    saved = json.loads((out / "report.json").read_text())
    assert saved == json.loads(json.dumps(rep.to_dict()))
    assert saved["formats"] == ["compressed-tensors"]
    assert {r["name"]: r["type"] for r in saved["layers"]} == p.ct["schemes"]
    for r in saved["layers"]:
        assert r["bits"] == pytest.approx(
            ct_scheme(r["type"]).layer_bits(*r["shape"]) / (r["shape"][0] * r["shape"][1])
        )
        assert 0 < r["rel_error"] < 0.05
    assert saved["metrics"]["load_check"]["class"] == "LlamaForCausalLM"
    assert 4.25 < saved["bits_per_weight"] < 4.6
    assert saved["bytes_after"] < saved["bytes_before"]
    model = AutoModelForCausalLM.from_pretrained(str(out / "compressed-tensors")).eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_calibrated_job_runs_gptq_in_each_scheme_at_the_same_size(
    tiny: Path, tmp_path: Path
) -> None:
    """With a calibration text every block layer is quantized by GPTQ in its scheme: the same
    schemes and bytes as the data-free job, other codes, and a calibration entry in the report
    (that GPTQ lowers the output error: tests/engine/test_ct_gptq.py)."""
    from safetensors.torch import load_file

    from higgs_engine.calibration import CalibrationRequest

    text = " ".join(f"word{i % 53} and then" for i in range(1500))
    planned: list[JobPlan] = []
    cal = CalibrationRequest(text, 256, label="file:words.txt")
    job = QuantizeJob(tiny, ct=CtOptions(bits=4), calibration=cal, on_plan=planned.append)
    rep = run(job, tmp_path / "cal")
    free = run(QuantizeJob(tiny, ct=CtOptions(bits=4)), tmp_path / "free")
    (p,) = planned
    assert p.calibration is not None and p.calibration["tokens"] == 256
    assert JobPlan.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    entry = rep.metrics["calibration"]
    assert entry["method"] == "gptq" and entry["source"] == "file:words.txt"
    assert entry["layers_calibrated"] == len(rep.layers) and entry["layers_without_data"] == []
    assert "calibrating" in rep.timings
    assert [(r.name, r.type, r.bytes) for r in rep.layers] == [
        (r.name, r.type, r.bytes) for r in free.layers
    ]
    assert rep.bits_per_weight == free.bits_per_weight
    a = load_file(str(tmp_path / "cal" / "compressed-tensors" / "model.safetensors"))
    b = load_file(str(tmp_path / "free" / "compressed-tensors" / "model.safetensors"))
    assert a.keys() == b.keys()
    packed = [k for k in a if k.endswith("weight_packed")]
    assert packed and any(not torch.equal(a[k], b[k]) for k in packed)
    assert rep.metrics["load_check"]["class"] == "LlamaForCausalLM"


def test_bits_8_and_an_encoder(tmp_path: Path) -> None:
    enc = build_tiny_encoder(tmp_path / "bert")
    rep = run(QuantizeJob(enc, ct=CtOptions(bits=8)), tmp_path / "out")
    assert {r.type for r in rep.layers} == {"w8a16"}
    assert rep.metrics["load_check"]["class"] == "BertModel"


def test_avg_bits_allocates_over_the_menu_within_the_budget(
    tiny: Path, tiny_profile: Profile, tmp_path: Path
) -> None:
    rep = run(allocated(tiny, tiny_profile, 6.0), tmp_path / "out")
    alloc = rep.metrics["allocation"]
    assert alloc["avg_bits"] <= 6.0
    assert rep.bits_per_weight == pytest.approx(alloc["avg_bits"], rel=1e-9)
    assert len({r.type for r in rep.layers}) >= 2  # a mix: 6 bits is between int4 and int8
    # the report's predicted change (from each layer's measured t^2) is the allocator's
    assert rep.metrics["predicted_kl"] == pytest.approx(alloc["predicted_kl"], rel=0.05)
    assert all(r.alpha is not None for r in rep.layers)
    # more budget never predicts worse
    more = run(allocated(tiny, tiny_profile, 8.5), tmp_path / "more")
    assert more.metrics["allocation"]["predicted_kl"] <= alloc["predicted_kl"]


def test_an_impossible_budget_names_the_smallest_and_leaves_nothing(
    tiny: Path, tiny_profile: Profile, tmp_path: Path
) -> None:
    with pytest.raises(InfeasibleTargetError, match=r"\d\.\d"):
        run(allocated(tiny, tiny_profile, 2.0), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_bad_jobs_and_plans_fail_naming_the_field(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match="bits=3") as e:
        plan(QuantizeJob(tiny, ct=CtOptions(bits=3)))
    assert e.value.field == "bits"
    with pytest.raises(InvalidConfigError, match="dtype") as e:
        plan(QuantizeJob(tiny, ct=CtOptions(bits=4, dtype="float32")))
    assert e.value.field == "dtype"
    with pytest.raises(InvalidConfigError) as e:
        QuantizeJob(tiny, ct=CtOptions())  # neither bits nor a target
    assert e.value.field == "bits"
    good = plan(QuantizeJob(tiny, ct=CtOptions(bits=4)))
    d: dict[str, Any] = good.to_dict()
    bad = json.loads(json.dumps(d))
    bad["ct"]["schemes"][next(iter(bad["ct"]["schemes"]))] = "w3"
    with pytest.raises(InvalidConfigError, match="'w3'"):
        JobPlan.from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["ct"] = None
    with pytest.raises(InvalidConfigError) as e:
        JobPlan.from_dict(bad)
    assert e.value.field == "ct"
    assert list(tmp_path.iterdir()) == []
