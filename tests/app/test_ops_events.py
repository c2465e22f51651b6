"""Operations endpoints, OpenAPI, plans, Server-Sent Events and concurrent idempotent submits
against a real uvicorn server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.db.models import Job, Profile
from app.jobs import state
from app.main import create_app
from app.queue import queue_depth
from app.settings import Settings
from tests.fixtures import METRICS_AUTH, assert_problem, serve_app

BODY = {"model": {"id": "tiny"}, "target": {"bits": 4}}


@pytest.fixture
def live_url(settings: Settings) -> Iterator[str]:
    """The app served by a real uvicorn server in a background thread."""
    fast = settings.model_copy(update={"events_poll_interval_s": 0.05})
    with serve_app(fast) as url:
        yield url


def test_healthz_readyz_openapi_docs_need_no_key(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"database": "ok", "broker": "ok", "store": "ok"}
    spec = client.get("/openapi.json").json()
    assert (
        "/v1/jobs" in spec["paths"]
        and "/v1/jobs/{job_id}/artifacts/{format}/files/{path}" in spec["paths"]
    )
    assert "JobCreate" in spec["components"]["schemas"]
    assert "bearer" in json.dumps(spec["components"]["securitySchemes"]).lower()
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_readyz_503_when_database_is_not_migrated(settings: Settings, tmp_path: Any) -> None:
    bare = settings.model_copy(update={"database_url": f"sqlite:///{tmp_path / 'empty.db'}"})
    with TestClient(create_app(bare)) as c:
        ready = c.get("/readyz")
        body = assert_problem(ready, 503)
        assert body["checks"] == {"database": "unavailable", "broker": "ok", "store": "ok"}
        assert ready.headers["retry-after"] == "5"
        assert "alembic_version" not in ready.text and "sqlite" not in ready.text.lower()


def test_metrics(client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]) -> None:
    ids = [client.post("/v1/jobs", json=BODY, headers=auth).json()["id"] for _ in range(3)]
    with sessions() as s:
        state.claim(s, ids[0], "w")
        state.record_progress(s, ids[0], "loading", 0, 1)
        state.record_progress(s, ids[0], "quantizing", 0, 4)
        state.succeed(s, ids[0], {"layers": []}, [], [])
    client.get(f"/v1/jobs/{ids[1]}", headers=auth)
    r = client.get("/metrics", headers=METRICS_AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'higgs_jobs{status="queued"} 2.0' in text
    assert 'higgs_jobs{status="succeeded"} 1.0' in text
    assert 'higgs_jobs{status="failed"} 0.0' in text
    assert 'higgs_queue_depth{queue="higgs"} 3.0' in text
    assert 'higgs_recent_stage_duration_seconds{stage="loading",stat="count"} 1.0' in text
    assert 'higgs_recent_stage_duration_seconds{stage="quantizing",stat="mean"}' in text
    # Latency by route template, not by raw path (bounded label cardinality).
    assert (
        'higgs_http_request_duration_seconds_count{method="POST",route="/v1/jobs",status="202"} 3.0'
        in text
    )
    assert 'route="/v1/jobs/{job_id}",status="200"' in text
    assert ids[1] not in text


def test_metrics_need_their_own_key_and_keep_labels_bounded(
    client: TestClient, auth: dict[str, str], settings: Settings
) -> None:
    assert_problem(client.get("/metrics"), 401)
    # A tenant's API key is not the metrics key.
    assert_problem(client.get("/metrics", headers=auth), 401)
    assert_problem(client.get("/metrics", headers={"Authorization": "Bearer wrong"}), 401)
    for i in range(30):
        client.request(f"MADEUP{i}", "/v1/jobs", headers=auth)
        client.get(f"/v1/jobs/no-such-job-{i}", headers=auth)
        client.get(f"/random/path/{i}")
    text = client.get("/metrics", headers=METRICS_AUTH).text
    series = [
        line
        for line in text.splitlines()
        if line.startswith("higgs_http_request_duration_seconds_count")
    ]
    assert not any(
        "MADEUP" in line or "no-such-job" in line or "/random" in line for line in series
    )
    assert any('method="other"' in line for line in series), series
    assert any('route="/v1/jobs/{job_id}",status="404"' in line for line in series), series
    assert len(series) < 10, series
    off = settings.model_copy(update={"metrics_key": None})
    with TestClient(create_app(off)) as c:
        assert_problem(c.get("/metrics", headers=METRICS_AUTH), 404)


def test_plans_seam(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    body = {"model": {"id": "org/model"}, "target": {"avg_bits": 3.5}}
    r = client.post("/v1/plans", json=body, headers=auth)
    problem = assert_problem(r, 404)
    assert problem["code"] == "no_profile" and "org/model" in problem["detail"]
    assert_problem(
        client.post(
            "/v1/plans", json={"model": {"id": "a/b/c"}, "target": {"bits": 4}}, headers=auth
        ),
        422,
        "model.id",
    )
    assert_problem(client.post("/v1/plans", json={**body, "x": 1}, headers=auth), 422, "x")
    assert_problem(client.post("/v1/plans", json=body), 401)
    with sessions() as s:
        # A row this service did not write (no versioned payload) is never planned with.
        s.add(
            Profile(
                model_id="org/model",
                revision="abc",
                metric="kl",
                text_hash="0" * 64,
                token_budget=1000,
                data={},
            )
        )
        s.commit()
    assert assert_problem(client.post("/v1/plans", json=body, headers=auth), 404)["code"] == (
        "no_profile"
    )


def test_sse_stream_follows_the_job(
    live_url: str, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    with httpx.Client(base_url=live_url, headers=auth, timeout=30) as http:
        jid = http.post("/v1/jobs", json=BODY).json()["id"]

        def drive() -> None:
            time.sleep(0.3)
            with sessions() as s:
                state.claim(s, jid, "w")
                for i in range(3):
                    time.sleep(0.2)
                    state.record_progress(s, jid, "quantizing", i + 1, 3)
                time.sleep(0.2)
                state.succeed(s, jid, {"layers": []}, [], [])

        driver = threading.Thread(target=drive)
        events: list[tuple[str, dict[str, Any]]] = []
        with http.stream("GET", f"/v1/jobs/{jid}/events") as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            driver.start()
            event = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    event = line[len("event: ") :]
                elif line.startswith("data: ") and event:
                    events.append((event, json.loads(line[len("data: ") :])))
        driver.join()
    kinds = [e for e, _ in events]
    assert kinds[0] == "state" and events[0][1]["status"] == "queued"
    assert events[-1][0] == "state" and events[-1][1]["status"] == "succeeded"
    assert [d["status"] for e, d in events if e == "state"] == ["queued", "running", "succeeded"]
    done = [d["progress"]["done"] for e, d in events if e == "progress"]
    assert done and done == sorted(done) and done[-1] == 3
    assert {d["progress"]["unit"] for e, d in events if e == "progress"} == {"layer"}


def test_sse_ends_at_once_for_a_finished_job(client: TestClient, auth: dict[str, str]) -> None:
    jid = client.post("/v1/jobs", json=BODY, headers=auth).json()["id"]
    client.post(f"/v1/jobs/{jid}/cancel", headers=auth)
    r = client.get(f"/v1/jobs/{jid}/events", headers=auth)
    assert r.status_code == 200
    assert r.text.count("event: state") == 1 and '"status": "cancelled"' in r.text


def test_twenty_concurrent_identical_submits_make_one_job(
    live_url: str, auth: dict[str, str], sessions: sessionmaker[Session], settings: Settings
) -> None:
    headers = {**auth, "Idempotency-Key": "same-request"}
    barrier = threading.Barrier(20)

    def one(_: int) -> tuple[int, str]:
        with httpx.Client(base_url=live_url, timeout=60) as http:
            barrier.wait()
            r = http.post("/v1/jobs", json=BODY, headers=headers)
            return r.status_code, r.json().get("id", r.text)

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    assert {code for code, _ in results} == {202}, results
    assert len({jid for _, jid in results}) == 1
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 1
    assert queue_depth(settings) == 1  # enqueued exactly once
