"""Per-key rate limits and the concurrent-jobs quota (429 + Retry-After), and 503 + Retry-After
while the database is unreachable."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.keys.service import create_key
from app.main import create_app
from app.settings import Settings
from tests.fixtures import assert_problem

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
