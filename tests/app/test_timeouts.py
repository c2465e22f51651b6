"""Nothing waits forever on a dependency that stops answering: a Redis frozen with SIGSTOP (it
still accepts connections, the kernel does that, but never replies), a "PostgreSQL" that accepts
and never speaks, a statement that runs too long. The API answers within seconds: /readyz 503
with Retry-After naming the dependency, a submission 202 (the sweep sends it later), a request
that needs the database 503 database_unavailable. Real servers and sockets on loopback."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from app.db.models import Job
from app.db.session import create_db_engine
from app.main import create_app
from app.settings import Settings
from tests.app.factories import make_key
from tests.fixtures import assert_problem, serve_app

# The port this test's own redis-server listens on (loopback only).
FROZEN_REDIS_PORT = 6402


class FrozenRedis:
    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc, self.url = proc, url

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[FrozenRedis]:
    """A private redis-server on 127.0.0.1:6402 that the test may freeze (SIGSTOP)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", FROZEN_REDIS_PORT)) == 0:
            pytest.skip(f"port {FROZEN_REDIS_PORT} is in use")
    proc = subprocess.Popen(
        [binary, "--port", str(FROZEN_REDIS_PORT), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", FROZEN_REDIS_PORT)) == 0:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
        yield FrozenRedis(proc, f"redis://127.0.0.1:{FROZEN_REDIS_PORT}/0")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections (the kernel's backlog) and never says a word: what a
    frozen database server looks like to a client."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield int(s.getsockname()[1])


def _timed_get(url: str, **kw: object) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.get(url, timeout=30, **kw)  # type: ignore[arg-type]
    return r, time.monotonic() - t0


def test_readyz_with_a_frozen_broker_is_503_within_seconds(
    settings: Settings, redis_server: FrozenRedis
) -> None:
    on_redis = settings.model_copy(update={"broker_url": redis_server.url})
    with serve_app(on_redis) as base:
        assert httpx.get(f"{base}/readyz", timeout=30).status_code == 200
        redis_server.freeze()
        try:
            time.sleep(on_redis.readyz_cache_s + 0.2)  # past the cached "ok"
            for _ in range(3):  # every request, not only the first, answers in time
                r, took = _timed_get(f"{base}/readyz")
                body = assert_problem(r, 503)
                assert body["checks"]["broker"] == "unavailable", body
                assert body["checks"]["database"] == "ok" and r.headers["retry-after"] == "5"
                assert took < on_redis.readyz_timeout_s + 4, f"/readyz took {took:.1f} s"
        finally:
            redis_server.thaw()
        deadline = time.monotonic() + 20
        while httpx.get(f"{base}/readyz", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "/readyz did not turn ready after the thaw"
            time.sleep(0.2)


def test_submit_with_a_frozen_broker_is_accepted_within_seconds(
    settings: Settings, sessions: sessionmaker[Session], redis_server: FrozenRedis
) -> None:
    """The job row is committed first; a broker that does not answer fails the send after the
    broker timeout, and the sweep sends the job later (enqueued_at stays NULL)."""
    on_redis = settings.model_copy(update={"broker_url": redis_server.url})
    with sessions() as s:
        _, key = make_key(s, "alice")
    with serve_app(on_redis) as base:
        redis_server.freeze()
        try:
            t0 = time.monotonic()
            r = httpx.post(
                f"{base}/v1/jobs",
                json={"model": {"id": "tiny"}, "target": {"bits": 4}},
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            )
            took = time.monotonic() - t0
        finally:
            redis_server.thaw()
    assert r.status_code == 202, r.text
    assert took < 15, f"the submission took {took:.1f} s"
    with sessions() as s:
        row = s.get(Job, r.json()["id"])
        assert row is not None and row.enqueued_at is None


def test_a_database_that_never_answers_is_503_within_seconds(
    settings: Settings, silent_server: int
) -> None:
    silent = settings.model_copy(
        update={
            "database_url": f"postgresql+psycopg://higgs@127.0.0.1:{silent_server}/higgs",
            "db_connect_timeout_s": 2,
        }
    )
    with serve_app(silent) as base:
        r, took = _timed_get(f"{base}/readyz")
        body = assert_problem(r, 503)
        assert body["checks"]["database"] == "unavailable" and r.headers["retry-after"]
        assert took < silent.readyz_timeout_s + 4, f"/readyz took {took:.1f} s"

        r, took = _timed_get(f"{base}/v1/jobs", headers={"Authorization": "Bearer hk_whatever"})
        body = assert_problem(r, 503)
        assert body["code"] == "database_unavailable" and r.headers["retry-after"] == "5"
        assert took < silent.db_connect_timeout_s + 6, f"the request took {took:.1f} s"


def test_the_apis_statements_have_a_statement_timeout(
    postgres_session_db: str, tmp_path: Path
) -> None:
    settings = Settings(
        data_dir=tmp_path / "data", database_url=postgres_session_db, db_statement_timeout_s=1
    )
    app = create_app(settings)
    try:
        t0 = time.monotonic()
        with (
            pytest.raises(sa_exc.OperationalError, match="statement timeout"),
            app.state.engine.connect() as conn,
        ):
            conn.execute(text("SELECT pg_sleep(5)"))
        assert time.monotonic() - t0 < 4
    finally:
        app.state.engine.dispose()


def _postmaster_pid(url: str) -> int:
    engine = create_db_engine(url)
    try:
        with engine.connect() as conn:
            data_dir = conn.execute(text("SHOW data_directory")).scalar_one()
    finally:
        engine.dispose()
    return int((Path(data_dir) / "postmaster.pid").read_text().split()[0])


def test_a_stopped_postgres_server_costs_a_request_seconds(
    postgres_session_db: str, tmp_path: Path
) -> None:
    """The test PostgreSQL's postmaster stopped with SIGSTOP: it still accepts connections (the
    kernel does) but never starts a session. A request that needs a new connection is a 503
    within the connect timeout, /readyz within its own; both work again after SIGCONT."""
    pid = _postmaster_pid(postgres_session_db)
    settings = Settings(
        data_dir=tmp_path / "data", database_url=postgres_session_db, db_connect_timeout_s=2
    )
    with serve_app(settings) as base:
        os.kill(pid, signal.SIGSTOP)
        try:
            r, took = _timed_get(f"{base}/v1/jobs", headers={"Authorization": "Bearer hk_x"})
            body = assert_problem(r, 503)
            assert body["code"] == "database_unavailable" and r.headers["retry-after"] == "5"
            assert took < 8, f"the request took {took:.1f} s"
            r, took = _timed_get(f"{base}/readyz")
            assert assert_problem(r, 503)["checks"]["database"] == "unavailable"
            assert took < settings.readyz_timeout_s + 4, f"/readyz took {took:.1f} s"
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/readyz", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "/readyz did not turn ready after SIGCONT"
            time.sleep(0.2)


def _cluster_pids(postmaster: int) -> list[int]:
    """The postmaster and every process it has started (backends, background workers)."""
    out = subprocess.run(
        ["pgrep", "-P", str(postmaster)], capture_output=True, text=True, check=False
    ).stdout
    return [postmaster, *(int(p) for p in out.split())]


# slow: waits out a request deadline on a frozen server
@pytest.mark.slow
def test_a_frozen_postgres_cluster_costs_a_request_its_deadline(
    postgres_session_db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every process of the test PostgreSQL cluster stopped with SIGSTOP: a query on a pooled
    connection never returns (no statement_timeout can fire, the kernel still ACKs so keepalives
    do not), yet reads and submissions are 503 dependency_timeout with Retry-After within the
    request deadline, /healthz stays fast, the late answers of the stuck requests go nowhere
    without a traceback, and the API serves normally again after SIGCONT."""
    from app import deadline
    from tests.app.dbutil import empty_postgres

    if shutil.which("pgrep") is None:
        pytest.skip("pgrep is not installed")
    empty_postgres(postgres_session_db)
    postmaster = _postmaster_pid(postgres_session_db)
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=postgres_session_db,
        models_dir=models,
        db_connect_timeout_s=2,
        db_pool_size=4,
        request_timeout_s=3,
        auth_cache_ttl_s=0,
        # Two threads: the third request below finds both stuck and waits for one, and is
        # answered at its deadline all the same.
        threadpool_size=2,
    )
    engine = create_db_engine(postgres_session_db)
    try:
        with sessionmaker(engine)() as s:
            _, key = make_key(s, "alice")
    finally:
        engine.dispose()
    auth = {"Authorization": f"Bearer {key}"}
    submission = {"model": {"id": "tiny"}, "target": {"bits": 4}}
    caplog.set_level(logging.INFO)
    with serve_app(settings) as base, httpx.Client(base_url=base, timeout=60) as client:
        r = client.post("/v1/jobs", json=submission, headers=auth)
        assert r.status_code == 202, r.text
        job = r.json()["id"]
        for _ in range(5):  # a warm pool: what the requests below check out
            assert client.get(f"/v1/jobs/{job}", headers=auth).status_code == 200
            assert client.get("/v1/jobs", headers=auth).status_code == 200
        pids = _cluster_pids(postmaster)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            calls = [
                ("GET", f"/v1/jobs/{job}", None),
                ("GET", "/v1/jobs", None),
                ("POST", "/v1/jobs", submission),
            ]
            for method, path, body in calls:
                t0 = time.monotonic()
                r = client.request(method, path, json=body, headers=auth)
                took = time.monotonic() - t0
                problem = assert_problem(r, 503)
                assert problem["code"] == "dependency_timeout", problem
                assert r.headers["retry-after"] == str(settings.unavailable_retry_after_s)
                assert took < settings.request_timeout_s + 2, f"{method} {path}: {took:.1f} s"
            r, took = _timed_get(f"{base}/healthz")
            assert r.status_code == 200 and took < 1, f"/healthz took {took:.1f} s"
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        deadline_at = time.monotonic() + 30
        while True:  # the stuck requests finish once the database answers
            r = client.get(f"/v1/jobs/{job}", headers=auth)
            if r.status_code == 200 and not deadline._orphans:
                break
            assert time.monotonic() < deadline_at, f"not serving after SIGCONT: {r.text}"
            time.sleep(0.2)
        assert client.get("/v1/jobs", headers=auth).status_code == 200
        r = client.post("/v1/jobs", json=submission, headers=auth)
        assert r.status_code == 202, r.text
    tracebacks = [rec.getMessage() for rec in caplog.records if rec.exc_info]
    assert not tracebacks, tracebacks
    warnings = [
        rec.getMessage() for rec in caplog.records if "request deadline" in rec.getMessage()
    ]
    assert warnings and "of 2 threads busy" in warnings[0], warnings
