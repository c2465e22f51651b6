"""Per-key rate limits and the concurrent-jobs quota (429 + Retry-After), and 503 + Retry-After
while the database is unreachable."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.jobs import state
from app.keys.service import create_key
from app.main import create_app
from app.settings import Settings
from tests.app.factories import make_job
from tests.fixtures import assert_problem, serve_app

BODY = {"model": {"id": "tiny"}, "target": {"bits": 4}}


def test_rate_limit_per_key_is_429_with_retry_after(
    settings: Settings, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    limited = settings.model_copy(update={"rate_limit_per_s": 0.2, "rate_limit_burst": 3})
    with sessions() as s:
        _, other = create_key(s, "bob")
    with TestClient(create_app(limited)) as c:
        assert [c.get("/v1/jobs", headers=auth).status_code for _ in range(3)] == [200] * 3
        r = c.get("/v1/jobs", headers=auth)
        body = assert_problem(r, 429)
        assert body["code"] == "rate_limited"
        assert 1 <= int(r.headers["retry-after"]) <= 5, r.headers
        # Buckets are per key: another key is not limited by this one.
        assert c.get("/v1/jobs", headers={"Authorization": f"Bearer {other}"}).status_code == 200
        # Unauthenticated requests are refused before any bucket is touched.
        assert_problem(c.get("/v1/jobs"), 401)


def test_rate_limit_zero_switches_it_off(settings: Settings, auth: dict[str, str]) -> None:
    off = settings.model_copy(update={"rate_limit_per_s": 0, "rate_limit_burst": 1})
    with TestClient(create_app(off)) as c:
        assert {c.get("/v1/jobs", headers=auth).status_code for _ in range(20)} == {200}


def test_concurrent_jobs_quota(settings: Settings, auth: dict[str, str]) -> None:
    quota = settings.model_copy(update={"max_active_jobs_per_key": 2})
    with TestClient(create_app(quota)) as c:
        first = c.post("/v1/jobs", json=BODY, headers={**auth, "Idempotency-Key": "a"})
        assert first.status_code == 202
        assert c.post("/v1/jobs", json=BODY, headers=auth).status_code == 202
        r = c.post("/v1/jobs", json=BODY, headers=auth)
        body = assert_problem(r, 429)
        assert body["code"] == "quota_exceeded" and "2" in body["detail"]
        assert int(r.headers["retry-after"]) >= 1
        # A replay of an existing job is not a new job: never refused by the quota.
        again = c.post("/v1/jobs", json=BODY, headers={**auth, "Idempotency-Key": "a"})
        assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
        # A finished (here: cancelled) job frees its place.
        assert c.post(f"/v1/jobs/{first.json()['id']}/cancel", headers=auth).status_code == 200
        assert c.post("/v1/jobs", json=BODY, headers=auth).status_code == 202


def test_database_down_is_503_with_retry_after_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    down = Settings(
        data_dir=tmp_path / "data",
        # Nothing listens on port 1: every connection attempt is refused.
        database_url="postgresql+psycopg://postgres@127.0.0.1:1/higgs",
        db_pool_timeout_s=1.0,
    )
    with TestClient(create_app(down), raise_server_exceptions=False) as c:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            answers = [
                c.get("/v1/jobs", headers={"Authorization": "Bearer higgs_x"}) for _ in range(4)
            ]
            answers.append(c.post("/v1/jobs", json=BODY, headers={"Authorization": "Bearer k"}))
        for r in answers:
            body = assert_problem(r, 503)
            assert body["code"] == "database_unavailable"
            assert r.headers["retry-after"] == "5"
            assert "127.0.0.1" not in r.text and "psycopg" not in r.text
        ours = [rec for rec in caplog.records if rec.name.startswith("app")]
        assert len(ours) == 1, [rec.getMessage() for rec in ours]
        assert ours[0].exc_info is None and "database unavailable" in ours[0].getMessage()
        assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
        ready = c.get("/readyz")
        assert_problem(ready, 503)
        assert ready.json()["checks"]["database"] == "unavailable"


def test_failed_authentications_are_limited_per_address_without_lookups(
    settings: Settings, auth: dict[str, str]
) -> None:
    strict = settings.model_copy(update={"auth_failures_per_s": 0.01, "auth_failures_burst": 3})
    app = create_app(strict)
    cache = app.state.key_cache
    lookups = 0
    load = cache.load

    def counted(token: str) -> Any:
        nonlocal lookups
        lookups += 1
        return load(token)

    cache.load = counted
    with TestClient(app) as c:
        assert c.get("/v1/jobs", headers=auth).status_code == 200  # now cached
        assert lookups == 1
        for i in range(3):
            r = c.get("/v1/jobs", headers={"Authorization": f"Bearer higgs_random{i}"})
            assert_problem(r, 401)
        assert lookups == 4
        for i in range(3, 10):
            r = c.get("/v1/jobs", headers={"Authorization": f"Bearer higgs_random{i}"})
            body = assert_problem(r, 429)
            assert (
                "HIGGS_AUTH_FAILURES_PER_S" in body["detail"] and int(r.headers["retry-after"]) >= 1
            )
        assert lookups == 4, "a refused key still cost a database lookup"
        # A cached refusal answers 401 as before (no lookup), the cached key still works.
        assert_problem(c.get("/v1/jobs", headers={"Authorization": "Bearer higgs_random0"}), 401)
        assert c.get("/v1/jobs", headers=auth).status_code == 200
        assert lookups == 4
    off = settings.model_copy(update={"auth_failures_per_s": 0})
    with TestClient(create_app(off)) as c:
        for i in range(30):
            r = c.get("/v1/jobs", headers={"Authorization": f"Bearer higgs_other{i}"})
            assert_problem(r, 401)


def _open_stream(base: str, path: str, key: str) -> tuple[socket.socket, int]:
    """A raw GET of an event stream: the socket (still open) and the status."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1024)
        if not chunk:
            break
        head += chunk
    return sock, int(head.split(b" ", 2)[1])


def test_open_event_streams_per_key_are_capped(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    capped = settings.model_copy(
        update={"max_event_streams_per_key": 2, "events_poll_interval_s": 0.05}
    )
    with sessions() as s:
        row, key = create_key(s, "alice")
        brow, other = create_key(s, "bob")
        jobs = [make_job(s, row.id).id for _ in range(3)]
        theirs = make_job(s, brow.id).id

    def wait_for_slot(base: str, path: str, what: str) -> socket.socket:
        deadline = time.monotonic() + 10
        while True:
            sock, status = _open_stream(base, path, key)
            if status == 200:
                return sock
            sock.close()
            assert status == 429 and time.monotonic() < deadline, f"{what}: {status}"
            time.sleep(0.1)

    with serve_app(capped) as base:
        first, status1 = _open_stream(base, f"/v1/jobs/{jobs[0]}/events", key)
        second, status2 = _open_stream(base, f"/v1/jobs/{jobs[1]}/events", key)
        assert (status1, status2) == (200, 200)
        r = httpx.get(f"{base}/v1/jobs/{jobs[2]}/events", headers=_auth(key), timeout=10)
        body = assert_problem(r, 429)
        assert "HIGGS_MAX_EVENT_STREAMS_PER_KEY = 2" in body["detail"], body
        assert r.headers["retry-after"] == "5"
        # Another key has its own streams.
        theirs_sock, status = _open_stream(base, f"/v1/jobs/{theirs}/events", other)
        assert status == 200
        theirs_sock.close()
        # A stream that ends (its job finished) gives its slot back...
        with sessions() as s:
            state.request_cancel(s, jobs[0])
        third = wait_for_slot(base, f"/v1/jobs/{jobs[2]}/events", "after the job ended")
        # ... and so does a stream whose client went away.
        second.close()
        fourth = wait_for_slot(base, f"/v1/jobs/{jobs[1]}/events", "after the client left")
        for sock in (first, third, fourth):
            sock.close()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_shared_rate_limit_falls_back_to_the_process_while_redis_is_down() -> None:
    import asyncio

    from app.errors import TooManyRequestsError
    from app.limits import SharedRateLimiter

    # Nothing listens on port 1: Redis refuses at once; the process's own bucket answers.
    limiter = SharedRateLimiter("redis://127.0.0.1:1/0", 0.1, 3, timeout_s=0.5)

    async def run() -> list[bool]:
        out = []
        for _ in range(5):
            try:
                await limiter.acheck("k")
                out.append(True)
            except TooManyRequestsError:
                out.append(False)
        return out

    assert asyncio.run(run()) == [True, True, True, False, False]
