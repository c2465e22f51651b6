"""Dynamic HIGGS jobs through the real runner: a real tiny checkpoint, the real engine
(profile by noise injection on random tokens, the DP allocator, the quantizer), a migrated
SQLite database, and POST /v1/plans answered from the profile the job stored."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

import higgs_engine.dynamic as engine_dynamic
from app.db.models import Job, Profile
from app.jobs import state
from app.keys.service import create_key
from app.main import create_app
from app.settings import Settings
from higgs_engine.planning.plans import KL_TO_PPL
from higgs_engine.profile import compute_profile
from higgs_engine.report import Report
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import files_under
from tests.worker.helpers import cancel_mid_run, create_job
from worker.config import RunnerConfig
from worker.runner import run_job

# native only: the dequantized copy adds time and nothing to these checks
NATIVE = {"formats": ["native"]}
AVG = {"model": {"id": MODEL}, "target": {"avg_bits": 3.5}, "options": NATIVE}


@pytest.fixture
def dyn_settings(settings: Settings) -> Settings:
    # A tiny token budget: one window of 16 random tokens per evaluation.
    return settings.model_copy(update={"profile_context": 16, "profile_windows": 1})


@pytest.fixture
def dyn_cfg(dyn_settings: Settings) -> RunnerConfig:
    return RunnerConfig.from_settings(dyn_settings, "cpu")


@pytest.fixture
def stages(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every stage the runner writes, in order (a spy around the real state function)."""
    seen: list[str] = []
    real = state.record_progress

    def spy(session: Session, job_id: str, stage: str, done: int, total: int, **kw: Any) -> bool:
        if not seen or seen[-1] != stage:
            seen.append(stage)
        return real(session, job_id, stage, done, total, **kw)

    monkeypatch.setattr(state, "record_progress", spy)
    return seen


@pytest.fixture
def profile_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the engine measured a profile (a spy around compute_profile)."""
    calls: list[int] = []
    real = compute_profile  # the function higgs_engine.dynamic calls, spied on there

    def spy(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(engine_dynamic, "compute_profile", spy)
    return calls


@pytest.fixture
def client(
    dyn_settings: Settings, sessions: sessionmaker[Session]
) -> Iterator[tuple[TestClient, dict[str, str]]]:
    with sessions() as s:
        _, secret = create_key(s, "plans")
    with TestClient(create_app(dyn_settings)) as c:
        yield c, {"Authorization": f"Bearer {secret}"}


def _job(sessions: sessionmaker[Session], job_id: str) -> Job:
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        _ = job.artifacts, job.layers
        s.expunge_all()
        return job


def _profiles(sessions: sessionmaker[Session]) -> list[Profile]:
    with sessions() as s:
        rows = list(s.scalars(select(Profile)).all())
        s.expunge_all()
        return rows


def test_avg_bits_job_profiles_allocates_and_predicts(
    dyn_settings: Settings,
    sessions: sessionmaker[Session],
    dyn_cfg: RunnerConfig,
    stages: list[str],
    profile_runs: list[int],
) -> None:
    job_id = create_job(sessions, dyn_settings, AVG)
    out = run_job(sessions, job_id, dyn_cfg, worker_id="w1")
    assert out.status == "succeeded", out.detail
    job = _job(sessions, job_id)
    assert job.status == "succeeded"

    # Stages in order: the profile is measured, then allocated, then quantized.
    order = [s for s in stages if s in ("profiling", "allocating", "quantizing")]
    assert order == ["profiling", "allocating", "quantizing"], stages
    assert {"profiling", "allocating", "quantizing"} <= set(job.stage_durations or {})
    assert profile_runs == [1]

    # Per-layer rows: each layer's alpha and its own choice, and the choices are mixed.
    assert job.layers and all(la.alpha is not None for la in job.layers)
    choices = {(la.p, la.n) for la in job.layers}
    assert len(choices) >= 2, choices
    # Every overhead counted: the report's figure (codes + scales + grids + 16-bit layers)
    # is within the budget, and the layer bytes alone never exceed it.
    rep = Report.from_dict(job.report or {})
    numel = sum(la.shape[0] * la.shape[1] for la in rep.layers)
    assert 8 * sum(la.bytes for la in rep.layers) / numel <= rep.bits_per_weight <= 3.5
    assert rep.bits_per_weight > 2.5  # the budget is used, not wasted
    # The native artifact's files are what the report counts (within tensor headers/metadata).
    assert job.summary is not None and job.summary["bits_per_weight"] == rep.bits_per_weight

    # The predicted change, recomputed here from the rows: sum alpha * t^2, then exp(KL) - 1.
    m = rep.metrics
    pred_kl = math.fsum(la.alpha * la.rel_error for la in rep.layers if la.alpha is not None)
    assert m["metric"] == "kl" and m["predicted_kl"] == pytest.approx(pred_kl, rel=1e-9)
    assert m["predicted_ppl_increase"] == pytest.approx(math.expm1(pred_kl), rel=1e-9)
    assert m["conversion"] == KL_TO_PPL and "exp(KL) - 1" in m["conversion"]
    assert job.summary["predicted_ppl_increase"] == m["predicted_ppl_increase"]
    assert m["target"] == {"avg_bits": 3.5}
    assert m["allocation"]["avg_bits"] <= 3.5
    assert m["service"]["profile"]["reused"] is None
    # The rows follow the allocation the report records.
    labels = m["allocation"]["layers"]
    for la in rep.layers:
        assert labels[la.name] == ("fp16" if la.p == 0 else f"p{la.p}n{la.n}")

    # The profile is indexed in the database (data-free: random tokens) and cached on disk.
    rows = _profiles(sessions)
    assert len(rows) == 1
    row = rows[0]
    assert row.model_id == MODEL and row.metric == "kl" and row.token_budget == 16
    assert row.revision.startswith("local:") and row.text_hash == "self:t1:p0.95:0"
    assert row.data["profile"]["complete"] and len(row.data["profile"]["layers"]) == len(rep.layers)
    assert len(list(dyn_settings.profiles_path.glob("profile-*.json"))) == 1
    # data-free: text the model generated itself, cached next to the profile; Fisher estimate
    assert len(list(dyn_settings.profiles_path.glob("selfgen-*.safetensors"))) == 1
    assert row.data["profile"]["config"]["method"] == "fisher"


def test_second_job_reuses_the_profile_and_max_ppl_increase_works(
    dyn_settings: Settings,
    sessions: sessionmaker[Session],
    dyn_cfg: RunnerConfig,
    stages: list[str],
    profile_runs: list[int],
) -> None:
    first = create_job(sessions, dyn_settings, AVG)
    assert run_job(sessions, first, dyn_cfg).status == "succeeded"
    assert profile_runs == [1]
    stages.clear()

    r = 0.05
    body = {"model": {"id": MODEL}, "target": {"max_ppl_increase": r}, "options": NATIVE}
    second = create_job(sessions, dyn_settings, body)
    out = run_job(sessions, second, dyn_cfg)
    assert out.status == "succeeded", out.detail
    job = _job(sessions, second)
    assert profile_runs == [1]  # no second measurement
    assert "profiling" not in stages and "profiling" not in (job.stage_durations or {})
    assert stages.index("allocating") < stages.index("quantizing")
    m = (job.report or {})["metrics"]
    assert m["service"]["profile"]["reused"] == "database"
    assert m["target"] == {"max_ppl_increase": r}
    # The dual: the smallest allocation whose predicted KL (from the grids' MSE) <= log(1 + r).
    assert m["allocation"]["predicted_kl_grid_mse"] <= math.log1p(r) + 1e-12
    assert m["allocation"]["predicted_ppl_increase"] <= r + 1e-12
    assert all(la.alpha is not None for la in job.layers)
    assert len(_profiles(sessions)) == 1


def test_plans_404_before_and_the_jobs_allocation_after(
    dyn_settings: Settings,
    sessions: sessionmaker[Session],
    dyn_cfg: RunnerConfig,
    client: tuple[TestClient, dict[str, str]],
) -> None:
    http, auth = client
    body = {"model": {"id": MODEL}, "target": {"avg_bits": 3.5}}
    r = http.post("/v1/plans", json=body, headers=auth)
    assert r.status_code == 404 and r.json()["code"] == "no_profile", r.text
    assert "submit a job with a dynamic target" in r.json()["detail"]

    job_id = create_job(sessions, dyn_settings, AVG)
    assert run_job(sessions, job_id, dyn_cfg).status == "succeeded"
    job = _job(sessions, job_id)

    r = http.post("/v1/plans", json=body, headers=auth)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["metric"] == "kl" and plan["conversion"] == KL_TO_PPL
    assert plan["model"]["revision"].startswith("local:")
    assert plan["profile"]["tokens"] == 16 and plan["profile"]["layers"] == len(job.layers)
    # Exactly the allocation the job got (same profile, menu, sizes and resolution).
    got = {row["name"]: (row["p"], row["n"]) for row in plan["allocation"]["layers"]}
    assert got == {la.name: (la.p, la.n) for la in job.layers}
    assert plan["allocation"]["avg_bits"] <= 3.5
    # The curve: more bits, lower predicted KL, and ppl increase = exp(KL) - 1.
    pts = plan["pareto"]
    assert len(pts) >= 5
    bits = [p["avg_bits"] for p in pts]
    kls = [p["predicted_kl"] for p in pts]
    assert bits == sorted(bits) and all(a > b for a, b in itertools.pairwise(kls))
    for p in pts:
        assert p["predicted_ppl_increase"] == pytest.approx(math.expm1(p["predicted_kl"]))
    # Curve only, and the dual.
    r = http.post("/v1/plans", json={"model": {"id": MODEL}}, headers=auth)
    assert r.status_code == 200 and r.json()["allocation"] is None and r.json()["pareto"] == pts
    r = http.post(
        "/v1/plans",
        json={"model": {"id": MODEL}, "target": {"max_ppl_increase": 0.05}},
        headers=auth,
    )
    assert r.status_code == 200 and r.json()["allocation"]["predicted_ppl_increase"] <= 0.05
    # A uniform job on the profiled model reports the predicted change in its report too (no
    # new profile); its summary's predicted_ppl_increase stays null (a dynamic target's figure).
    uniform = create_job(
        sessions, dyn_settings, {"model": {"id": MODEL}, "target": {"bits": 4}, "options": NATIVE}
    )
    assert run_job(sessions, uniform, dyn_cfg).status == "succeeded"
    u = _job(sessions, uniform)
    assert {(la.p, la.n) for la in u.layers} == {(2, 256)}
    pred = math.fsum((la.alpha or 0.0) * (la.rel_error or 0.0) for la in u.layers)
    assert all(la.alpha is not None for la in u.layers) and pred > 0
    assert u.summary is not None and u.summary["predicted_ppl_increase"] is None
    assert u.report is not None
    assert u.report["metrics"]["predicted_ppl_increase"] == pytest.approx(
        math.expm1(pred), rel=1e-9
    )
    # Below this model's exact floor (grids and scales of its real shapes): 422 naming the field.
    r = http.post(
        "/v1/plans", json={"model": {"id": MODEL}, "target": {"avg_bits": 1.1}}, headers=auth
    )
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "target.avg_bits" and "feasible" in r.json()["detail"]


def test_infeasible_budget_for_this_model_fails_the_job_clearly(
    dyn_settings: Settings, sessions: sessionmaker[Session], dyn_cfg: RunnerConfig
) -> None:
    # Above the up-front floor (1.0625) but below this tiny model's real one: its layers are
    # narrower than a scale group, and each grid's storage is large next to 61k weights.
    job_id = create_job(
        sessions, dyn_settings, {"model": {"id": MODEL}, "target": {"avg_bits": 1.1}}
    )
    out = run_job(sessions, job_id, dyn_cfg)
    assert out.status == "failed"
    job = _job(sessions, job_id)
    assert job.error_code == "infeasible_target" and "avg_bits=1.1" in (job.error_message or "")
    assert job.artifacts == [] and files_under(dyn_settings.artifacts_path) == []
    assert len(_profiles(sessions)) == 1  # the profile it measured is kept for the next job


def test_cancel_during_profiling_stops_between_layers_and_resumes_later(
    dyn_settings: Settings,
    sessions: sessionmaker[Session],
    dyn_cfg: RunnerConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Noise injection profiles one layer at a time, so a partial profile can be resumed (the
    # default Fisher estimate is a few whole-model passes, measured at once).
    dyn_settings = dyn_settings.model_copy(update={"profile_method": "noise"})
    dyn_cfg = RunnerConfig.from_settings(dyn_settings, "cpu")
    job_id = create_job(sessions, dyn_settings, AVG)
    slow = dataclasses.replace(dyn_cfg, debug_layer_delay_s=0.3, progress_min_interval_s=0.0)
    outcome = cancel_mid_run(
        sessions,
        job_id,
        lambda: run_job(sessions, job_id, slow),
        lambda: (j := _job(sessions, job_id)).stage == "probing" and j.progress_done >= 2,
        "two profiled layers",
    )
    assert outcome.status == "cancelled"
    job = _job(sessions, job_id)
    assert job.status == "cancelled" and job.layers == [] and job.artifacts == []
    total = job.progress_total
    assert 2 <= job.progress_done < total
    assert _profiles(sessions) == []  # only complete profiles are indexed
    partial = list(dyn_settings.profiles_path.glob("profile-*.json"))
    assert len(partial) == 1
    saved = json.loads(partial[0].read_text())
    assert not saved["complete"] and 2 <= len(saved["layers"]) < total
    kept = len(saved["layers"])

    # The next job resumes the partial profile instead of starting over.
    seen: list[tuple[int, int]] = []
    real = state.record_progress

    def spy(session: Session, jid: str, stage: str, done: int, tot: int, **kw: Any) -> bool:
        if stage == "probing":
            seen.append((done, tot))
        return real(session, jid, stage, done, tot, **kw)

    monkeypatch.setattr(state, "record_progress", spy)
    again = create_job(sessions, dyn_settings, AVG)
    fast = dataclasses.replace(dyn_cfg, progress_min_interval_s=0.0)
    assert run_job(sessions, again, fast).status == "succeeded"
    assert seen and seen[0] == (kept, total)
    assert len(_profiles(sessions)) == 1
    assert Path(partial[0]).is_file()


def test_scope_all_job_allocates_the_embedding_after_a_linear_job(
    dyn_settings: Settings,
    sessions: sessionmaker[Session],
    dyn_cfg: RunnerConfig,
    profile_runs: list[int],
) -> None:
    """options.scope "all" reaches the worker: the token embedding and the untied head are
    profiled (a linear job's profile lacks them, so it is measured again and stored), allocated
    within the budget and quantized; the whole-model bits per parameter drop below the linear
    job's, and a later linear job reuses the profile that covers more layers."""
    linear = create_job(sessions, dyn_settings, AVG)
    assert run_job(sessions, linear, dyn_cfg).status == "succeeded"
    body = {**AVG, "options": {**NATIVE, "scope": "all"}}
    job_id = create_job(sessions, dyn_settings, body)
    out = run_job(sessions, job_id, dyn_cfg)
    assert out.status == "succeeded", out.detail
    assert profile_runs == [1, 1]
    job, lin = _job(sessions, job_id), _job(sessions, linear)
    rep = Report.from_dict(job.report or {})
    rows = {la.name: la for la in rep.layers}
    assert {"model.embed_tokens", "lm_head"} <= set(rep.metrics["allocation"]["layers"])
    assert rows["model.embed_tokens"].alpha is not None
    assert rep.metrics["scope"] == "all" and rep.metrics["allocation"]["avg_bits"] <= 3.5
    assert {la.name for la in job.layers} == set(rows)
    assert job.summary is not None and lin.summary is not None
    assert job.summary["bits_per_param_total"] < 0.7 * lin.summary["bits_per_param_total"]
    again = create_job(sessions, dyn_settings, {**AVG, "options": {**NATIVE, "seed": 1}})
    assert run_job(sessions, again, dyn_cfg).status == "succeeded"
    assert profile_runs == [1, 1]
