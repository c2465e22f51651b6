"""Per-key limits that hold across API processes: two real uvicorn processes on one PostgreSQL
database and one Redis (the compose shape)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from sqlalchemy import func, select, text

from app.db.models import Job
from app.db.session import create_db_engine, session_factory
from devtools.stack import Stack

BODY = {"model": {"id": "tiny"}, "target": {"bits": 4}}


def two_apis(stack: Stack, **env: str) -> tuple[str, list[str]]:
    """Migrate, create a key, start two API processes: (key, their base URLs)."""
    stack.env.update(env)
    stack.migrate()
    key = stack.create_key("fair")
    urls = []
    for _ in range(2):
        stack.start_api()
        urls.append(stack.url)
    return key, urls


def test_job_quota_holds_across_two_api_processes(stack_factory: Any) -> None:
    stack: Stack = stack_factory("redis-postgres")
    key, urls = two_apis(stack, HIGGS_MAX_ACTIVE_JOBS_PER_KEY="20", HIGGS_RATE_LIMIT_PER_S="0")
    auth = {"Authorization": f"Bearer {key}"}
    engine = create_db_engine(stack.env["HIGGS_DATABASE_URL"])
    # A slow insert (as on a busy database): 50 ms between a submission's count of the key's
    # jobs and its commit, a wide window for concurrent submissions to count the same jobs.
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE FUNCTION slow_insert() RETURNS trigger AS "
                "$$ BEGIN PERFORM pg_sleep(0.05); RETURN NEW; END $$ LANGUAGE plpgsql"
            )
        )
        conn.execute(
            text(
                "CREATE TRIGGER slow_insert BEFORE INSERT ON jobs "
                "FOR EACH ROW EXECUTE FUNCTION slow_insert()"
            )
        )

    def submit(i: int) -> int:
        r = httpx.post(f"{urls[i % 2]}/v1/jobs", json=BODY, headers=auth, timeout=60)
        return r.status_code

    with ThreadPoolExecutor(80) as pool:
        statuses = list(pool.map(submit, range(80)))
    assert sorted(set(statuses)) == [202, 429], statuses
    assert statuses.count(202) == 20, statuses
    try:
        with session_factory(engine)() as s:
            assert s.scalar(select(func.count()).select_from(Job)) == 20
    finally:
        engine.dispose()


def test_rate_limit_holds_across_two_api_processes(stack_factory: Any) -> None:
    stack: Stack = stack_factory("redis-postgres")
    rate, burst = 4.0, 20
    key, urls = two_apis(stack, HIGGS_RATE_LIMIT_PER_S=str(rate), HIGGS_RATE_LIMIT_BURST=str(burst))
    auth = {"Authorization": f"Bearer {key}"}
    clients = [httpx.Client(base_url=u, headers=auth, timeout=30) for u in urls]
    try:
        for c in clients:  # the key is cached in both processes; these two count
            assert c.get("/v1/jobs?limit=1").status_code == 200
        allowed = 2
        t0 = time.monotonic()
        for i in range(400):  # bounded: about 3 s of requests, alternating processes
            r = clients[i % 2].get("/v1/jobs?limit=1")
            assert r.status_code in (200, 429), r.text
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
            allowed += r.status_code == 200
            if time.monotonic() - t0 > 3:
                break
        took = time.monotonic() - t0
    finally:
        for c in clients:
            c.close()
    # One bucket for both processes: the burst plus the rate over the time taken (with a
    # tolerance of 3 requests). A bucket per process would allow twice as many.
    most = burst + rate * took + 3
    assert burst <= allowed <= most, (
        f"{allowed} requests allowed in {took:.1f} s, at most {most:.0f}"
    )


def _healthz_count(base: str, metrics_key: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {metrics_key}"}, timeout=30)
    assert r.status_code == 200, r.text
    total = 0.0
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if (
                sample.name == "higgs_http_request_duration_seconds_count"
                and sample.labels.get("route") == "/healthz"
            ):
                total += sample.value
    return total


def test_metrics_sum_every_api_process(stack_factory: Any, tmp_path: Any) -> None:
    stack: Stack = stack_factory("redis-postgres")
    folder = tmp_path / "prometheus"
    folder.mkdir()
    _, urls = two_apis(stack, HIGGS_METRICS_KEY="mk", PROMETHEUS_MULTIPROC_DIR=str(folder))
    for base, n in zip(urls, (7, 5), strict=True):
        for _ in range(n):
            assert httpx.get(f"{base}/healthz", timeout=30).status_code == 200
    # Whichever process answers the scrape, it reports the requests both of them served.
    assert [_healthz_count(u, "mk") for u in urls] == [12.0, 12.0]
    assert len(list(folder.glob("histogram_*.db"))) == 2
