"""Dynamic HIGGS glue: target -> allocation -> overrides -> quantize -> annotated report (the
`higgs plan` / `higgs profile` / dynamic `higgs quantize` commands: tests/cli/test_dynamic_cmds.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from higgs_engine.errors import InfeasibleTargetError, InvalidConfigError
from higgs_engine.job import ProfileSource, QuantizeJob, run
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.planning.options import option_menu
from higgs_engine.planning.plans import (
    Target,
    build_table,
    config_with_allocation,
    metric_bound_for_ppl,
    plan_allocation,
    ppl_increase_from,
    predict_change,
)
from higgs_engine.planning.profile import LayerAlpha, Profile, ProfileConfig
from higgs_engine.report import Report
from tests.fixtures import build_tiny_checkpoint, measure_tiny_profile

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("dyn") / "llama")


@pytest.fixture(scope="module")
def profile_file(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return measure_tiny_profile(ckpt, tmp_path_factory.mktemp("profile") / "profile.json")


def fake_profile(
    names_shapes: list[tuple[str, int, int]], alphas: list[float], metric: str = "kl"
) -> Profile:
    return Profile(
        model="m",
        revision=None,
        calibration="random:0",
        config=ProfileConfig(metric=metric).to_dict(),
        layers=[
            LayerAlpha(n, [o, i], a) for (n, o, i), a in zip(names_shapes, alphas, strict=True)
        ],
        base={"ppl": 10.0},
        cost={"forward_passes": 0, "backward_passes": 0, "seconds": 0.0},
        complete=True,
    )


def test_target_takes_exactly_one_goal() -> None:
    with pytest.raises(InvalidConfigError, match="exactly one"):
        Target()
    with pytest.raises(InvalidConfigError, match="exactly one"):
        Target(avg_bits=4.0, max_ppl_increase=0.1)
    with pytest.raises(InvalidConfigError, match="avg_bits=-1"):
        Target(avg_bits=-1.0)
    with pytest.raises(InvalidConfigError, match="max_ppl_increase=nan"):
        Target(max_ppl_increase=float("nan"))


def test_kl_to_ppl_conversion_round_trips() -> None:
    assert metric_bound_for_ppl("kl", 0.05) == pytest.approx(math.log(1.05))
    assert ppl_increase_from("kl", math.log(1.05)) == pytest.approx(0.05)
    assert metric_bound_for_ppl("ppl", 0.05) == 0.05


def test_plan_meets_both_kinds_of_target() -> None:
    shapes = [(f"l{i}", 128, 256) for i in range(8)]
    prof = fake_profile(shapes, [0.01 * 3**i for i in range(8)])
    cfg = HiggsConfig()
    plan = plan_allocation(prof, cfg, Target(avg_bits=4.0))
    assert plan.allocation.avg_bits <= 4.0
    # the more sensitive a layer, the more bits it gets (same shapes)
    table = build_table(prof, cfg)
    bits = [table.problem.cost_bits[i, j] for i, j in enumerate(plan.allocation.choice)]
    assert bits == sorted(bits)
    dual = plan_allocation(prof, cfg, Target(max_ppl_increase=0.02))
    assert (ppl_increase_from("kl", dual.allocation.predicted) or 0.0) <= 0.02 + 1e-12
    # Pareto curve: bits up, predicted down
    xs = [p.avg_bits for p in plan.pareto]
    ys = [p.predicted for p in plan.pareto]
    assert xs == sorted(xs) and ys == sorted(ys, reverse=True)
    with pytest.raises(InfeasibleTargetError, match=r"avg_bits=0\.5"):
        plan_allocation(prof, cfg, Target(avg_bits=0.5))
    d = plan.to_dict()
    assert (
        d["conversion"].startswith("ppl_increase = exp(KL) - 1")
        and len(d["allocation"]["layers"]) == 8
    )


def test_profile_missing_a_layer_is_an_error() -> None:
    prof = fake_profile([("a", 64, 64)], [1.0])
    with pytest.raises(InvalidConfigError, match="'b'"):
        plan_allocation(prof, HiggsConfig(), Target(avg_bits=4.0), names=["a", "b"])


def test_predict_change_sums_alpha_times_measured_error() -> None:
    prof = fake_profile([("a", 64, 64), ("b", 64, 64)], [2.0, 0.5])
    pred = predict_change(prof, {"a": 0.01, "b": 0.1, "c": 0.3})
    assert pred["predicted_kl"] == pytest.approx(2.0 * 0.01 + 0.5 * 0.1)
    assert pred["predicted_ppl_increase"] == pytest.approx(math.expm1(0.07))
    assert pred["unprofiled"] == ["c"]


def test_config_with_allocation_keeps_other_overrides() -> None:
    from higgs_engine.planning.config import LayerOverride

    prof = fake_profile([("a", 64, 64), ("b", 64, 64)], [2.0, 0.5])
    base = HiggsConfig(overrides=(LayerOverride("z", 0, 0), LayerOverride("a", 1, 4)))
    plan = plan_allocation(prof, base, Target(avg_bits=5.0))
    cfg = config_with_allocation(base, plan.allocation)
    assert cfg.grid_for("z") is None
    assert [o.name for o in cfg.overrides] == ["z", "a", "b"]


def test_dynamic_job_writes_allocation_alphas_and_prediction(
    ckpt: Path, profile_file: Path, tmp_path: Path
) -> None:
    prof = Profile.load(profile_file)
    stages: list[str] = []
    job = QuantizeJob(
        ckpt,
        HiggsConfig(),
        target=Target(avg_bits=2.5),
        # small grids only: their nearest-point tables build fast
        profile=ProfileSource(profile=prof, menu=tuple(option_menu(max_code_bits=3.0))),
    )
    run(job, tmp_path / "out", lambda s, d, t: stages.append(s))
    assert stages.index("allocating") < stages.index("quantizing")
    saved = Report.load(tmp_path / "out" / "report.json")
    # the allocator's size model is the artifact's: the real bits (scales, grids, 16-bit layers)
    assert saved.bits_per_weight <= 2.5 + 1e-9
    alloc = saved.metrics["allocation"]
    assert saved.bits_per_weight == pytest.approx(alloc["avg_bits"], rel=1e-3)
    for row in saved.layers:
        assert row.alpha == prof.alphas()[row.name]
        opt = alloc["layers"][row.name]
        assert opt == ("fp16" if row.p == 0 else f"p{row.p}n{row.n}")
    expected = math.fsum(row.alpha * row.rel_error for row in saved.layers if row.alpha is not None)
    assert saved.metrics["predicted_kl"] == pytest.approx(expected)
    assert saved.metrics["conversion"].startswith("ppl_increase = exp(KL)")
    assert len({row.bits for row in saved.layers}) > 1  # really dynamic


def test_a_local_model_has_one_cached_profile_however_its_path_is_spelled(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from devtools.profiles import obtain
    from higgs_engine.planning.profile import ProfileDirectory

    cfg = ProfileConfig(method="fisher", windows=1, context=16, data_free="random")
    stores = (ProfileDirectory(tmp_path / "cache"),)
    first = obtain(ckpt, cfg, stores=stores)
    assert first.reused is None  # measured
    monkeypatch.chdir(ckpt.parent)
    for spelling in (ckpt.name, f"./{ckpt.name}", f"../{ckpt.parent.name}/{ckpt.name}"):
        again = obtain(spelling, cfg, stores=stores)
        assert again.reused == "cache_dir", spelling
        assert again.profile.alphas() == first.profile.alphas()
    assert len(list((tmp_path / "cache").glob("profile-*.json"))) == 1


def _stored_profile(layers: list[str], *, complete: bool = True) -> tuple[Profile, Any]:
    from higgs_engine.planning.profile import ProfileRequest

    cfg = ProfileConfig(context=8, windows=1)
    prof = Profile(
        model="m",
        revision="r",
        calibration="random:0",
        config=cfg.to_dict(),
        layers=[LayerAlpha(n, [4, 8], 1.0) for n in layers],
        base={},
        cost={},
        complete=complete,
    )
    return prof, ProfileRequest("m", "r", "random:0", cfg, ("a", "b"))


def test_profile_request_accepts_only_complete_matching_covering_profiles() -> None:
    prof, req = _stored_profile(["a", "b", "c"])
    assert req.accepts(prof)
    assert not req.accepts(_stored_profile(["a", "b"], complete=False)[0])
    assert not req.accepts(_stored_profile(["a"])[0])  # layer b missing
    other = dataclasses.replace(req, config=ProfileConfig(context=8, windows=2))
    assert not other.accepts(prof)
    assert not dataclasses.replace(req, calibration="random:1").accepts(prof)


def test_find_profile_takes_the_first_store_and_copies_it_to_earlier_ones(tmp_path: Path) -> None:
    from higgs_engine.planning.profile import ProfileDirectory, ProfileFile, find_profile

    prof, req = _stored_profile(["a", "b"])
    out, cache = ProfileFile(tmp_path / "out.json"), ProfileDirectory(tmp_path / "cache")
    assert find_profile([out, cache], req) is None
    cache.save(prof, req)
    found = find_profile([out, cache], req)
    assert found is not None and found[1] is cache and found[0].to_dict() == prof.to_dict()
    assert out.find(req) is not None  # the store searched first got a copy
    (tmp_path / "out.json").write_text("{not json")  # a broken entry is no profile
    assert out.find(req) is None
    # a profile of another model revision in the same file is not reused
    assert ProfileFile(tmp_path / "x.json").find(req) is None
    cache.save(prof, req)
    assert cache.find(dataclasses.replace(req, revision="other")) is None
