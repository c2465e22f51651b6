"""POST /v1/plans over stored profiles (the worker tests plan from a profile a real job
measured; here the profiles are written directly, so every branch is cheap to reach), and the
profiles index the worker and the API share."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.plans.planner import avg_bits_floor, compute_plan
from app.plans.profiles import find_profiles, store_profile
from higgs_engine.planning.allocator import KEEP_16, AllocLayer, Option, build_problem, solve
from higgs_engine.planning.plans import KL_TO_PPL
from higgs_engine.planning.profile import Profile
from tests.fixtures import assert_problem

SHA = "a" * 40
# Shapes of a small model whose rows span whole scale groups: 8 layers, alphas 300x apart.
SHAPES = [(256, 512), (512, 256), (256, 256), (1024, 256)] * 2


def profile_dict(
    metric: str = "kl", complete: bool = True, model: str = "org/model"
) -> dict[str, Any]:
    layers = [
        {
            "name": f"layers.{i}.proj",
            "shape": list(s),
            "alpha": 0.01 * (1 + i) ** 2.7,
            "points": [],
            "tr_fisher": None,
        }
        for i, s in enumerate(SHAPES)
    ]
    return {
        "model": model,
        "revision": SHA,
        "calibration": "random:0",
        "config": {
            "metric": metric,
            "method": "noise",
            "levels": [0.005, 0.02],
            "context": 64,
            "windows": 2,
            "seed": 0,
            "fisher_samples": 4,
        },
        "layers": layers,
        "base": {"ppl": 300.0},
        "cost": {"forward_passes": 17, "backward_passes": 0, "seconds": 1.5},
        "complete": complete,
        "version": 1,
    }


def store(
    sessions: sessionmaker[Session], prof: dict[str, Any], requested: str | None = "main"
) -> None:
    with sessions() as s:
        store_profile(
            s,
            model_id=prof["model"],
            revision=prof["revision"],
            profile=prof,
            key=Profile.from_dict(prof).key(),
            source={
                "id": prof["model"],
                "kind": "hub",
                "revision": SHA,
                "requested_revision": requested,
            },
        )


def plan(client: TestClient, auth: dict[str, str], **body: Any) -> Any:
    return client.post("/v1/plans", json={"model": {"id": "org/model"}, **body}, headers=auth)


def test_no_profile_is_a_clear_404(client: TestClient, auth: dict[str, str]) -> None:
    body = assert_problem(plan(client, auth, target={"avg_bits": 4}), 404)
    assert body["code"] == "no_profile" and "'org/model'" in body["detail"]
    assert "avg_bits or max_ppl_increase" in body["detail"]


def test_plan_for_avg_bits(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    store(sessions, profile_dict())
    r = plan(client, auth, target={"avg_bits": 3.5})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == {"id": "org/model", "revision": SHA}
    assert out["metric"] == "kl" and out["conversion"] == KL_TO_PPL
    assert out["profile"]["tokens"] == 128 and out["profile"]["layers"] == len(SHAPES)
    alloc = out["allocation"]
    assert alloc["avg_bits"] <= 3.5 and alloc["avg_bits"] > 3.0
    assert alloc["predicted_ppl_increase"] == pytest.approx(math.expm1(alloc["predicted_kl"]))
    rows = alloc["layers"]
    assert [r["name"] for r in rows] == [f"layers.{i}.proj" for i in range(len(SHAPES))]
    # Sensitive layers get at least as many code bits as the insensitive ones.
    bits = [math.inf if r["p"] == KEEP_16 else math.log2(r["n"]) / r["p"] for r in rows]
    assert bits[-1] >= bits[0] and len(set(bits)) >= 2
    # The same answer as the engine's allocator on the same problem.
    prof = Profile.from_dict(profile_dict())
    from higgs_engine.planning.plans import layer_specs_from_profile

    table = solve(build_problem(layer_specs_from_profile(prof)), None, 1e-4)
    ref = table.allocate(3.5)
    assert [(r["p"], r["n"]) for r in rows] == [(o.p, o.n) for o in ref.options]
    # The curve: cheapest first, each point strictly better than the one before.
    pts = out["pareto"]
    assert pts[0]["avg_bits"] == pytest.approx(table.problem.min_avg_bits(), abs=1e-3)
    assert all(a["avg_bits"] < b["avg_bits"] for a, b in itertools.pairwise(pts))
    assert all(a["predicted_kl"] > b["predicted_kl"] for a, b in itertools.pairwise(pts))


def test_plan_dual_curve_only_and_menu(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    store(sessions, profile_dict())
    r = plan(client, auth, target={"max_ppl_increase": 0.02})
    assert r.status_code == 200, r.text
    a = r.json()["allocation"]
    assert a["predicted_ppl_increase"] <= 0.02 and a["predicted_kl"] <= math.log1p(0.02)
    # A looser bound never costs more bits.
    loose = plan(client, auth, target={"max_ppl_increase": 0.2}).json()["allocation"]
    assert loose["avg_bits"] <= a["avg_bits"]
    only = plan(client, auth).json()
    assert only["allocation"] is None and len(only["pareto"]) >= 10
    # options.p restricts the menu: only p=1 grids (or 16 bits) are chosen.
    p1 = plan(client, auth, target={"avg_bits": 4}, options={"p": 1}).json()["allocation"]
    assert {r["p"] for r in p1["layers"]} <= {0, 1}


def test_revision_and_metric_matching(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    store(sessions, profile_dict(), requested="main")
    for rev in (SHA, "main"):
        r = plan(client, auth, model={"id": "org/model", "revision": rev}, target={"avg_bits": 4})
        assert r.status_code == 200, (rev, r.text)
    r = plan(client, auth, model={"id": "org/model", "revision": "v2"}, target={"avg_bits": 4})
    assert "at revision 'v2'" in assert_problem(r, 404)["detail"]
    r = plan(client, auth, target={"avg_bits": 4}, metric="ppl")
    assert "metric 'ppl'" in assert_problem(r, 404)["detail"]


def test_partial_profiles_are_never_planned_with(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    store(sessions, profile_dict(complete=False))
    assert_problem(plan(client, auth, target={"avg_bits": 4}), 404)
    with sessions() as s:
        assert find_profiles(s, "org/model") == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"target": {"bits": 4}}, "target.bits"),
        ({"target": {"avg_bits": 0.5}}, "target.avg_bits"),
        ({"target": {"avg_bits": 17}}, "target.avg_bits"),
        ({"target": {"max_ppl_increase": 0}}, "target.max_ppl_increase"),
        ({"target": {"max_ppl_increase": 11}}, "target.max_ppl_increase"),
        ({"target": {"avg_bits": 4}, "options": {"p": 3}}, "options.p"),
        ({"target": {"avg_bits": 4}, "options": {"group_size": 100}}, "options.group_size"),
        ({"target": {"avg_bits": 4}, "metric": "mse"}, "metric"),
    ],
)
def test_bad_plan_requests_are_422(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    body: dict[str, Any],
    field: str,
) -> None:
    store(sessions, profile_dict())
    assert_problem(plan(client, auth, **body), 422, field)


def test_store_profile_replaces_the_row_for_the_same_key(sessions: sessionmaker[Session]) -> None:
    store(sessions, profile_dict())
    newer = profile_dict()
    newer["layers"][0]["alpha"] = 123.0
    store(sessions, newer)
    with sessions() as s:
        rows = find_profiles(s, "org/model", SHA, "kl", calibration="random:0", token_budget=128)
        assert len(rows) == 1 and rows[0].data["profile"]["layers"][0]["alpha"] == 123.0


def test_compute_plan_directly_and_the_up_front_floor() -> None:
    out = compute_plan(profile_dict(), {"avg_bits": 2.5}, resolution=1e-3)
    assert out["allocation"]["avg_bits"] <= 2.5
    # The up-front floor is a true lower bound: the model's exact floor is above it.
    prob = build_problem(
        [AllocLayer("a", 256, 512, 1.0)],
        [Option(1, 2), Option(KEEP_16, 0)],
    )
    assert avg_bits_floor(256, 1) <= prob.min_avg_bits()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"rotation_block": 32}, "options.rotation_block"),
        ({"rotation_block": 8192}, "options.rotation_block"),
        ({"rotation_block": 96}, "options.rotation_block"),
        ({"group_size": 8192}, "options.group_size"),
        ({"group_size": 3}, "options.group_size"),
        ({"p": 3}, "options.p"),
        ({"group_size": "256"}, "options.group_size"),
    ],
)
def test_plan_options_are_checked_like_a_jobs_once_a_profile_exists(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    options: dict[str, Any],
    field: str,
) -> None:
    store(sessions, profile_dict())
    r = plan(client, auth, target={"avg_bits": 3.0}, options=options)
    assert_problem(r, 422, field)
    # The same options on a job are refused on the same field.
    job = client.post(
        "/v1/jobs",
        json={"model": {"id": "org/model"}, "target": {"bits": 4}, "options": options},
        headers=auth,
    )
    assert_problem(job, 422, field)


def test_plan_scope_leaves_out_or_includes_the_embedding(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    # A profile measured for a GGUF or scope="all" job also holds the embedding: a plan for the
    # linear layers (the default scope) leaves it out, scope "all" allocates it too.
    prof = profile_dict()
    prof["layers"].append(
        {
            "name": "model.embed_tokens",
            "shape": [4096, 256],
            "alpha": 0.5,
            "points": [],
            "tr_fisher": None,
        }
    )
    prof["embeddings"] = ["model.embed_tokens"]
    store(sessions, prof)
    lin = plan(client, auth, target={"avg_bits": 3.5})
    assert lin.status_code == 200, lin.text
    names = [r["name"] for r in lin.json()["allocation"]["layers"]]
    assert names == [f"layers.{i}.proj" for i in range(len(SHAPES))]
    assert lin.json()["profile"]["embedding_layers"] == ["model.embed_tokens"]
    both = plan(client, auth, target={"avg_bits": 3.5}, options={"scope": "all"})
    assert both.status_code == 200, both.text
    names = [r["name"] for r in both.json()["allocation"]["layers"]]
    assert "model.embed_tokens" in names and len(names) == len(SHAPES) + 1
    bad = plan(client, auth, target={"avg_bits": 3.5}, options={"scope": "some"})
    assert bad.status_code == 422 and "options.scope" in bad.text
