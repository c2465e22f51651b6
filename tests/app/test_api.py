"""The jobs API over HTTP (TestClient) against migrated SQLite and PostgreSQL databases."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.db.models import Job
from app.jobs import state
from app.keys.service import create_key, revoke_key
from app.main import create_app
from app.queue import queue_depth
from app.settings import Settings
from tests.fixtures import assert_problem

BODY: dict[str, Any] = {"model": {"id": "tiny"}, "target": {"bits": 4}}


def submit(
    client: TestClient,
    auth: dict[str, str],
    body: dict[str, Any] | None = None,
    idem: str | None = None,
) -> Any:
    headers = {**auth, **({"Idempotency-Key": idem} if idem is not None else {})}
    return client.post("/v1/jobs", json=body or BODY, headers=headers)


def test_submit_get_and_enqueue(
    client: TestClient, auth: dict[str, str], settings: Settings, sessions
) -> None:
    r = submit(client, auth)
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued" and job["stage"] is None
    assert job["progress"] == {"done": 0, "total": 0, "fraction": None}
    assert job["config"]["version"] == 1 and job["config"]["target"] == {"bits": 4.0}
    assert (job["config"]["engine"]["p"], job["config"]["engine"]["n"]) == (2, 256)
    assert job["request"]["options"]["formats"] == ["native", "dequantized"]
    assert job["artifacts"] == [] and job["error"] is None
    # Enqueued after commit: one message waits in the (filesystem) broker, enqueued_at is set.
    assert queue_depth(settings) == 1
    with sessions() as s:
        row = s.get(Job, job["id"])
        assert row is not None and row.enqueued_at is not None
    got = client.get(f"/v1/jobs/{job['id']}", headers=auth)
    assert got.status_code == 200 and got.json()["id"] == job["id"]


def test_bits_and_options_choose_the_grid(client: TestClient, auth: dict[str, str]) -> None:
    cases = [
        ({"bits": 4.5}, {}, (2, 512)),
        ({"bits": 3}, {}, (2, 64)),
        ({"bits": 4}, {"p": 1}, (1, 16)),
        ({"bits": 8}, {"n": 256, "p": 1}, (1, 256)),
    ]
    for target, options, grid in cases:
        r = submit(client, auth, {"model": {"id": "tiny"}, "target": target, "options": options})
        assert r.status_code == 202, r.text
        eng = r.json()["config"]["engine"]
        assert (eng["p"], eng["n"]) == grid


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": {"id": "tiny"}, "target": {"bits": 0.5}}, "target.bits"),
        ({"model": {"id": "tiny"}, "target": {"bits": -1}}, "target.bits"),
        ({"model": {"id": "tiny"}, "target": {"bits": "four"}}, "target.bits"),
        ({"model": {"id": "tiny"}, "target": {}}, "target"),
        ({"model": {"id": "tiny"}, "target": {"bits": 4, "avg_bits": 4}}, "target"),
        ({"model": {"id": "tiny"}, "target": {"avg_bits": 0.9}}, "target.avg_bits"),
        ({"model": {"id": "tiny"}, "target": {"avg_bits": 16.5}}, "target.avg_bits"),
        ({"model": {"id": "tiny"}, "target": {"avg_bits": -1}}, "target.avg_bits"),
        ({"model": {"id": "tiny"}, "target": {"avg_bits": "x"}}, "target.avg_bits"),
        (
            # one fp16 scale per 64 weights: the floor is 1 + 16/64 = 1.25 bits
            {"model": {"id": "tiny"}, "target": {"avg_bits": 1.2}, "options": {"group_size": 64}},
            "target.avg_bits",
        ),
        (
            {"model": {"id": "tiny"}, "target": {"avg_bits": 3.5}, "options": {"n": 256}},
            "options.n",
        ),
        (
            {"model": {"id": "tiny"}, "target": {"avg_bits": 3.5}, "options": {"p": 3}},
            "options.p",
        ),
        ({"model": {"id": "tiny"}, "target": {"max_ppl_increase": 0}}, "target.max_ppl_increase"),
        (
            {"model": {"id": "tiny"}, "target": {"max_ppl_increase": -0.1}},
            "target.max_ppl_increase",
        ),
        (
            {"model": {"id": "tiny"}, "target": {"max_ppl_increase": 50}},
            "target.max_ppl_increase",
        ),
        ({"model": {"id": "tiny"}, "target": {"bits": 4}, "options": {"p": 3}}, "options.p"),
        (
            {"model": {"id": "tiny"}, "target": {"bits": 4}, "options": {"group_size": 300}},
            "options.group_size",
        ),
        (
            {"model": {"id": "tiny"}, "target": {"bits": 4}, "options": {"rotation_block": 100}},
            "options.rotation_block",
        ),
        (
            {"model": {"id": "tiny"}, "target": {"bits": 4}, "options": {"formats": ["onnx"]}},
            "options.formats.0",
        ),
        (
            {
                "model": {"id": "tiny"},
                "target": {"bits": 4},
                "options": {"formats": ["gguf", "native"]},
            },
            "options.formats",
        ),
        (
            {"model": {"id": "tiny"}, "target": {"bits": 1.5}, "options": {"formats": ["gguf"]}},
            "target.bits",
        ),
        (
            {
                "model": {"id": "tiny"},
                "target": {"avg_bits": 2.5},
                "options": {"formats": ["gguf"]},
            },
            "target.avg_bits",
        ),
        (
            {
                "model": {"id": "tiny"},
                "target": {"bits": 4},
                "options": {"formats": ["gguf"], "calibration": "abc"},
            },
            "options.calibration",
        ),
        *[
            (
                {
                    "model": {"id": "tiny"},
                    "target": {"bits": 4},
                    "options": {"formats": ["gguf"], name: value},
                },
                f"options.{name}",
            )
            for name, value in [
                ("skip", ["*"]),
                ("p", 2),
                ("n", 256),
                ("dtype", "bfloat16"),
                ("group_size", 128),
                ("rotation_block", 512),
                ("sign_seed", None),
                ("scale_rule", "rms"),
                ("seed", 7),
            ]
        ],
        (
            {"model": {"id": "tiny"}, "target": {"bits": 100}, "options": {"formats": ["gguf"]}},
            "target.bits",
        ),
        (
            {
                "model": {"id": "tiny"},
                "target": {"avg_bits": 16.5},
                "options": {"formats": ["gguf"]},
            },
            "target.avg_bits",
        ),
        (
            {"model": {"id": "tiny"}, "target": {"bits": 4}, "options": {"formats": []}},
            "options.formats",
        ),
        (
            {"model": {"id": "tiny"}, "target": {"bits": 4}, "options": {"scope": "embeddings"}},
            "options.scope",
        ),
        (
            {"model": {"id": "tiny"}, "target": {"avg_bits": 4}, "options": {"scope": None}},
            "options.scope",
        ),
        (
            {
                "model": {"id": "tiny"},
                "target": {"bits": 4},
                "options": {"formats": ["gguf"], "scope": "linear"},
            },
            "options.scope",
        ),
        (
            {"model": {"id": "tiny"}, "target": {"bits": 2}, "options": {"p": 1, "n": 16}},
            "options.p",
        ),
        (
            {"model": {"id": "tiny"}, "target": {"bits": 4}, "options": {"bogus": 1}},
            "options.bogus",
        ),
        ({"model": {"id": "tiny"}, "target": {"bits": 4}, "extra": 1}, "extra"),
        ({"model": {"id": "../etc"}, "target": {"bits": 4}}, "model.id"),
        ({"model": {"id": "a/b/c"}, "target": {"bits": 4}}, "model.id"),
        ({"model": {"id": "/abs/path"}, "target": {"bits": 4}}, "model.id"),
        ({"model": {"id": "a\\b"}, "target": {"bits": 4}}, "model.id"),
        ({"model": {"id": "missing-local"}, "target": {"bits": 4}}, "model.id"),
        ({"model": {"id": "tiny", "revision": "main"}, "target": {"bits": 4}}, "model.revision"),
        (
            {"model": {"id": "org/model", "revision": "../x"}, "target": {"bits": 4}},
            "model.revision",
        ),
        ({"model": {"id": "org/model"}}, "target"),
        ({"target": {"bits": 4}}, "model"),
    ],
)
def test_invalid_requests_are_422_naming_the_field(
    client: TestClient,
    auth: dict[str, str],
    body: dict[str, Any],
    field: str,
    sessions,
) -> None:
    r = submit(client, auth, body)
    problem = assert_problem(r, 422, field)
    assert problem["detail"]
    with sessions() as s:  # nothing was created
        assert s.scalars(select(Job)).all() == []


def test_scope_reaches_the_engine_config(client: TestClient, auth: dict[str, str]) -> None:
    """options.scope "all" is carried in the job's engine config; the default (omitted or
    given) leaves the stored request and engine config exactly as they were before the option
    existed; a gguf job accepts "all" (it always quantizes the embedding)."""
    r = submit(client, auth, {**BODY, "options": {"scope": "all"}})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["config"]["engine"]["scope"] == "all"
    assert job["request"]["options"]["scope"] == "all"
    dyn = {"model": {"id": "tiny"}, "target": {"avg_bits": 4}, "options": {"scope": "all"}}
    r = submit(client, auth, dyn)
    assert r.status_code == 202, r.text
    assert r.json()["config"]["engine"]["scope"] == "all"
    for options in ({}, {"scope": "linear"}):
        r = submit(client, auth, {**BODY, "options": options})
        assert r.status_code == 202, r.text
        job = r.json()
        assert "scope" not in job["config"]["engine"]
        assert "scope" not in job["request"]["options"]
    gguf = {**BODY, "options": {"formats": ["gguf"], "scope": "all"}}
    r = submit(client, auth, gguf)
    assert r.status_code == 202, r.text
    assert r.json()["config"]["gguf"] is True


def test_dynamic_targets_switched_off_are_a_clear_422(
    settings: Settings, auth: dict[str, str]
) -> None:
    off = settings.model_copy(update={"dynamic_targets": False})
    with TestClient(create_app(off)) as c:
        r = c.post(
            "/v1/jobs", json={"model": {"id": "tiny"}, "target": {"avg_bits": 3.5}}, headers=auth
        )
        body = assert_problem(r, 422, "target.avg_bits")
        assert "not supported" in body["detail"] and body["code"] == "not_supported"


def test_dynamic_targets_are_accepted_by_default(client: TestClient, auth: dict[str, str]) -> None:
    for target in ({"avg_bits": 3.25}, {"max_ppl_increase": 0.05}, {"avg_bits": 16}):
        r = submit(client, auth, {"model": {"id": "tiny"}, "target": target})
        assert r.status_code == 202, r.text
        assert r.json()["config"]["target"] == target
    r = submit(
        client, auth, {"model": {"id": "tiny"}, "target": {"avg_bits": 2.5}, "options": {"p": 1}}
    )
    assert r.status_code == 202, r.text
    assert r.json()["config"]["menu_p"] == 1  # the worker restricts the allocator's menu to p=1
    # The range is named in the message.
    body = assert_problem(
        submit(client, auth, {"model": {"id": "tiny"}, "target": {"avg_bits": 0.9}}),
        422,
        "target.avg_bits",
    )
    assert "feasible range [1.062, 16]" in body["detail"]


def test_hub_ids_are_accepted_without_network(client: TestClient, auth: dict[str, str]) -> None:
    for mid, rev in [
        ("HuggingFaceTB/SmolLM2-135M", "main"),
        ("org/m.v2", "a" * 40),
        ("org/m", None),
    ]:
        body = {"model": {"id": mid, "revision": rev}, "target": {"bits": 4}}
        r = submit(client, auth, body)
        assert r.status_code == 202, r.text
        assert r.json()["model"] == {"id": mid, "revision": rev, "resolved_revision": None}


def test_malformed_and_oversized_bodies(
    client: TestClient, auth: dict[str, str], settings: Settings
) -> None:
    h = {**auth, "Content-Type": "application/json"}
    assert_problem(client.post("/v1/jobs", content=b"{not json", headers=h), 400)
    assert_problem(client.post("/v1/jobs", content=b"[1, 2]", headers=h), 422)
    assert_problem(client.post("/v1/jobs", content=b"", headers=h), 422)
    big = json.dumps({**BODY, "pad": "x" * (settings.max_body_bytes + 1)}).encode()
    body = assert_problem(client.post("/v1/jobs", content=big, headers=h), 413)
    assert str(settings.max_body_bytes) in body["detail"]

    # Chunked upload without Content-Length is counted as it arrives.
    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b" " * (settings.max_body_bytes // 4)

    assert_problem(client.post("/v1/jobs", content=chunks(), headers=h), 413)


def test_auth_required_and_revoked_keys(client: TestClient, auth: dict[str, str], sessions) -> None:
    job = submit(client, auth).json()
    for path in ["/v1/jobs", f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/layers"]:
        assert_problem(client.get(path), 401)
        assert_problem(client.get(path, headers={"Authorization": "Bearer nope"}), 401)
        assert_problem(client.get(path, headers={"Authorization": "Basic abc"}), 401)
    r = client.get("/v1/jobs")
    assert r.headers["www-authenticate"].startswith("Bearer")
    with sessions() as s:
        revoke_key(s, auth["Authorization"].split()[1])
    # Keys are cached in the API process for auth_cache_ttl_s (1 s): the revocation takes
    # effect within that, and from then on every request is refused.
    revoked_at = time.monotonic()
    while (r := client.get("/v1/jobs", headers=auth)).status_code == 200:
        assert time.monotonic() - revoked_at < 3, "the revoked key still works after 3 s"
        time.sleep(0.05)
    body = assert_problem(r, 401)
    assert "revoked" in body["detail"]
    assert_problem(client.get(f"/v1/jobs/{job['id']}", headers=auth), 401)


def test_other_key_sees_404(client: TestClient, auth: dict[str, str], sessions) -> None:
    job = submit(client, auth).json()
    with sessions() as s:
        _, other = create_key(s, "bob")
    bob = {"Authorization": f"Bearer {other}"}
    for path in [
        "",
        "/layers",
        "/report",
        "/events",
        "/artifacts/native",
        "/artifacts/native/files/x",
    ]:
        assert_problem(client.get(f"/v1/jobs/{job['id']}{path}", headers=bob), 404)
    assert_problem(client.post(f"/v1/jobs/{job['id']}/cancel", headers=bob), 404)
    assert client.get("/v1/jobs", headers=bob).json()["data"] == []
    assert_problem(client.get("/v1/jobs/does-not-exist", headers=auth), 404)


def test_idempotency_same_body_same_job_other_body_422(
    client: TestClient, auth: dict[str, str], settings: Settings
) -> None:
    a = submit(client, auth, idem="k-1")
    b = submit(client, auth, idem="k-1")
    assert a.status_code == b.status_code == 202
    assert a.json()["id"] == b.json()["id"]
    assert b.headers["idempotent-replayed"] == "true"
    # Semantically identical body (4 vs 4.0, defaults spelled out) is the same request.
    same = {"model": {"id": "tiny"}, "target": {"bits": 4.0}, "options": {"group_size": 256}}
    assert submit(client, auth, same, idem="k-1").json()["id"] == a.json()["id"]
    other = {"model": {"id": "tiny"}, "target": {"bits": 3}}
    assert_problem(submit(client, auth, other, idem="k-1"), 422, "Idempotency-Key")
    assert submit(client, auth, idem="k-2").json()["id"] != a.json()["id"]
    assert_problem(submit(client, auth, idem="has space"), 422, "Idempotency-Key")
    assert queue_depth(settings) == 2  # replays are not enqueued again


def test_list_pagination_and_filter(client: TestClient, auth: dict[str, str], sessions) -> None:
    ids = [submit(client, auth).json()["id"] for _ in range(5)]
    with sessions() as s:
        state.claim(s, ids[1], "w")
    seen: list[str] = []
    after = None
    while True:
        params: dict[str, Any] = {"limit": 2}
        if after:
            params["after"] = after
        page = client.get("/v1/jobs", params=params, headers=auth).json()
        seen += [j["id"] for j in page["data"]]
        assert len(page["data"]) <= 2
        if not page["has_more"]:
            assert page["next"] is None
            break
        after = page["next"]
    assert seen == list(reversed(ids))  # newest first, each exactly once
    running = client.get("/v1/jobs", params={"status": "running"}, headers=auth).json()
    assert [j["id"] for j in running["data"]] == [ids[1]]
    assert_problem(client.get("/v1/jobs", params={"status": "done"}, headers=auth), 422, "status")
    assert_problem(client.get("/v1/jobs", params={"limit": 0}, headers=auth), 422, "limit")
    assert_problem(client.get("/v1/jobs", params={"limit": "x"}, headers=auth), 422, "limit")
    assert_problem(client.get("/v1/jobs", params={"after": "garbage!"}, headers=auth), 422, "after")


def test_cancel(client: TestClient, auth: dict[str, str], sessions) -> None:
    queued = submit(client, auth).json()
    r = client.post(f"/v1/jobs/{queued['id']}/cancel", headers=auth)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert_problem(client.post(f"/v1/jobs/{queued['id']}/cancel", headers=auth), 409)

    running = submit(client, auth).json()
    with sessions() as s:
        state.claim(s, running["id"], "w")
    r = client.post(f"/v1/jobs/{running['id']}/cancel", headers=auth)
    assert r.json()["status"] == "running" and r.json()["cancel_requested"] is True
    with sessions() as s:
        assert state.record_progress(s, running["id"], "quantizing", 1, 4) is False
        state.mark_cancelled(s, running["id"])
    assert client.get(f"/v1/jobs/{running['id']}", headers=auth).json()["status"] == "cancelled"


def test_progress_layers_report_and_failure_views(
    client: TestClient, auth: dict[str, str], sessions, tmp_path: Path
) -> None:
    job = submit(client, auth).json()
    jid = job["id"]
    # The job exists but has no report yet: a conflict with its status, not "not found".
    assert assert_problem(client.get(f"/v1/jobs/{jid}/report", headers=auth), 409)["code"] == (
        "report_not_ready"
    )
    assert client.get(f"/v1/jobs/{jid}/layers", headers=auth).json() == {"job_id": jid, "data": []}
    with sessions() as s:
        state.claim(s, jid, "w")
        state.record_progress(s, jid, "quantizing", 3, 12)
    view = client.get(f"/v1/jobs/{jid}", headers=auth).json()
    assert view["stage"] == "quantizing" and view["progress"] == {
        "done": 3,
        "total": 12,
        "fraction": 0.25,
    }
    report = {
        "bits_per_weight": 4.06,
        "bytes_before": 100,
        "bytes_after": 30,
        "layers": [
            {
                "name": "m.q",
                "shape": [4, 8],
                "p": 2,
                "n": 256,
                "bits": 4.06,
                "rel_error": 0.01,
                "bytes": 20,
                "alpha": 0.5,
            }
        ],
        "metrics": {"kl": 0.01},
    }
    with sessions() as s:
        state.succeed(s, jid, report, None, [])
    assert client.get(f"/v1/jobs/{jid}/report", headers=auth).json() == report
    layers = client.get(f"/v1/jobs/{jid}/layers", headers=auth).json()["data"]
    assert layers == [
        {
            "name": "m.q",
            "shape": [4, 8],
            "p": 2,
            "n": 256,
            "bits": 4.06,
            "alpha": 0.5,
            "rel_error": 0.01,
            "bytes": 20,
            "type": None,
        }
    ]
    done = client.get(f"/v1/jobs/{jid}", headers=auth).json()
    assert done["status"] == "succeeded" and done["summary"]["bits_per_weight"] == 4.06
    assert done["summary"]["kl"] == 0.01

    failed = submit(client, auth).json()["id"]
    with sessions() as s:
        state.claim(s, failed, "w")
        state.fail(s, failed, "model_not_found", "no checkpoint at tiny")
    view = client.get(f"/v1/jobs/{failed}", headers=auth).json()
    assert view["error"] == {
        "code": "model_not_found",
        "message": "no checkpoint at tiny",
        "scratch_reclaimed_bytes": None,
    }


def test_broker_down_still_accepts_and_leaves_job_for_the_sweep(
    settings: Settings, auth: dict[str, str], sessions
) -> None:
    down = settings.model_copy(
        update={"broker_url": "redis://127.0.0.1:1/0", "broker_timeout_s": 0.5}
    )
    with TestClient(create_app(down)) as c:
        r = c.post("/v1/jobs", json=BODY, headers=auth)
        assert r.status_code == 202
        ready = c.get("/readyz")
        body = assert_problem(ready, 503)
        assert body["checks"] == {"database": "ok", "broker": "unavailable", "store": "ok"}
    with sessions() as s:
        row = s.get(Job, r.json()["id"])
        assert row is not None and row.enqueued_at is None
        from datetime import timedelta

        from app.db.base import utcnow

        assert state.list_unenqueued(s, utcnow() + timedelta(seconds=1)) == [row.id]


def test_unknown_route_and_method_are_problems(client: TestClient, auth: dict[str, str]) -> None:
    assert_problem(client.get("/nope"), 404)
    assert_problem(client.delete("/v1/jobs", headers=auth), 405)
    assert_problem(client.get("/v1/jobs/x/artifacts/onnx", headers=auth), 422, "format")
