"""Request handling that cannot exhaust the database pool: slow downloads, open event streams
and many concurrent pollers against a real uvicorn server on PostgreSQL with a deliberately
tiny pool (2 connections, 3 s checkout timeout). A route that held its connection across a
response body, a stream or a threadpool hop would starve the pollers (503 after 3 s)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.manifest import artifact_row
from app.db.session import create_db_engine, session_factory
from app.jobs import state
from app.keys.service import create_key, revoke_key
from app.settings import Settings
from tests.app.dbutil import empty_postgres
from tests.app.factories import make_job
from tests.fixtures import serve_app

FILE_BYTES = 8 * 1024 * 1024


@pytest.fixture
def pg_url(postgres_session_db: str) -> str:
    empty_postgres(postgres_session_db)
    return postgres_session_db


@pytest.fixture
def pg_sessions(pg_url: str) -> Iterator[sessionmaker[Session]]:
    engine = create_db_engine(pg_url)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


def serve(settings: Settings) -> Iterator[str]:
    with serve_app(settings) as url:
        yield url


@pytest.fixture
def tiny_pool_url(pg_url: str, tmp_path: Path) -> Iterator[str]:
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=pg_url,
        models_dir=models,
        db_pool_size=2,
        db_max_overflow=0,
        db_pool_timeout_s=3.0,
        rate_limit_per_s=0,
        events_poll_interval_s=0.05,
        auth_cache_ttl_s=0.5,
    )
    yield from serve(settings)


class SlowReader:
    """A raw HTTP/1.1 client that reads its response a few bytes at a time (like
    `curl --limit-rate`), with a tiny receive buffer so the server really waits on it."""

    def __init__(self, base: str, path: str, key: str) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(10)
        self.sock.connect((host, int(port)))
        self.sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
        )
        self.head = b""
        while b"\r\n\r\n" not in self.head:
            chunk = self.sock.recv(1024)
            if not chunk:
                break
            self.head += chunk
        self.received = len(self.head)
        self.closed = False
        self.sock.settimeout(0.05)

    @property
    def status(self) -> int:
        return int(self.head.split(b" ", 2)[1])

    def nibble(self) -> None:
        try:
            chunk = self.sock.recv(512)
        except (TimeoutError, OSError):
            return
        if not chunk:
            self.closed = True
        self.received += len(chunk)

    def close(self) -> None:
        self.sock.close()


def _setup_jobs(sessions: sessionmaker[Session], root: Path) -> tuple[str, str, str]:
    """(key, succeeded job with an 8 MiB file, running job)."""
    with sessions() as s:
        row, key = create_key(s, "load")
        done = make_job(s, row.id)
        running = make_job(s, row.id)
    store = root / "store" / done.id / "native"
    store.mkdir(parents=True)
    (store / "model.safetensors").write_bytes(b"\x01" * FILE_BYTES)
    with sessions() as s:
        state.claim(s, done.id, "w")
        state.succeed(s, done.id, {"layers": []}, [], [artifact_row("native", store)])
        state.claim(s, running.id, "w")
    return key, done.id, running.id


def test_slow_downloads_and_streams_do_not_starve_pollers(
    tiny_pool_url: str, pg_sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    base = tiny_pool_url
    key, done, running = _setup_jobs(pg_sessions, tmp_path)
    file_path = f"/v1/jobs/{done}/artifacts/native/files/model.safetensors"
    slow = [SlowReader(base, file_path, key) for _ in range(6)]
    slow += [SlowReader(base, f"/v1/jobs/{done}/artifacts/native/archive", key) for _ in range(3)]
    slow += [SlowReader(base, f"/v1/jobs/{running}/events", key) for _ in range(6)]
    assert [r.status for r in slow] == [200] * len(slow)

    stop = threading.Event()

    def nibble_all() -> None:
        while not stop.is_set():
            for r in slow:
                r.nibble()
            time.sleep(0.05)

    nibbler = threading.Thread(target=nibble_all, daemon=True)
    nibbler.start()

    def poll(i: int) -> list[tuple[int, float]]:
        out = []
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}) as c:
            for j in range(6):
                path = f"/v1/jobs/{running}" if (i + j) % 2 else "/v1/jobs?limit=5"
                t0 = time.perf_counter()
                r = c.get(path, timeout=30)
                out.append((r.status_code, time.perf_counter() - t0))
        return out

    try:
        with ThreadPoolExecutor(40) as pool:
            results = [x for xs in pool.map(poll, range(40)) for x in xs]
        ready = httpx.get(base + "/readyz", timeout=30)
    finally:
        stop.set()
        nibbler.join(5)
        streams_open = [not r.closed for r in slow]
        for r in slow:
            r.close()
    statuses = sorted({s for s, _ in results})
    assert statuses == [200], f"statuses {statuses}"
    assert ready.status_code == 200, ready.text
    # The downloads are far from done and the streams still open: they never held the pool.
    assert all(streams_open), streams_open
    assert max(r.received for r in slow[:6]) < FILE_BYTES


def test_revoked_key_ends_its_event_stream_and_is_refused(
    tiny_pool_url: str, pg_sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    base = tiny_pool_url
    key, _, running = _setup_jobs(pg_sessions, tmp_path)
    events: list[str] = []
    ended = threading.Event()

    def follow() -> None:
        with httpx.stream(
            "GET",
            f"{base}/v1/jobs/{running}/events",
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        ) as r:
            for line in r.iter_lines():
                events.append(line)
        ended.set()

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not any(e.startswith("event: state") for e in events):
        assert time.monotonic() < deadline, events
        time.sleep(0.05)
    assert (
        httpx.get(
            f"{base}/v1/jobs/{running}", headers={"Authorization": f"Bearer {key}"}
        ).status_code
        == 200
    )
    with pg_sessions() as s:
        revoke_key(s, key)
    revoked_at = time.monotonic()
    # The stream ends once the cached entry (0.5 s here) runs out; the job is still running.
    assert ended.wait(10), "the stream of a revoked key kept going"
    waited = time.monotonic() - revoked_at
    r = httpx.get(f"{base}/v1/jobs/{running}", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 401, r.text
    assert waited < 5, waited
    t.join(5)


@pytest.fixture
def plain_url(pg_url: str, tmp_path: Path) -> Iterator[str]:
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=pg_url,
        models_dir=models,
        rate_limit_per_s=0,
        db_statement_timeout_s=20,
    )
    yield from serve(settings)


def test_writes_waiting_on_locked_tables_leave_the_event_loop_free(
    plain_url: str, pg_url: str, pg_sessions: sessionmaker[Session]
) -> None:
    """Another connection holds the tables the writing routes write (calibrations, jobs,
    api_keys) locked while uploads, submits, cancels, webhook secret rotations and link requests
    wait on them: /healthz (no database) still answers at once, because no writing route runs
    its database work on the event loop."""
    from sqlalchemy import text

    base = plain_url
    with pg_sessions() as s:
        _, key = create_key(s, "writer")
    auth = {"Authorization": f"Bearer {key}"}
    body = b"The council met on Monday to discuss the new library budget. " * 200
    with httpx.Client(base_url=base, headers=auth) as c:  # the key is in the API's cache
        assert c.get("/v1/calibrations").status_code == 200
        assert c.get("/healthz").status_code == 200
        queued = c.post("/v1/jobs", json={"model": {"id": "tiny"}, "target": {"bits": 3}})
        assert queued.status_code == 202, queued.text
        job_id = queued.json()["id"]

    engine = create_db_engine(pg_url)
    locked = threading.Event()
    release = threading.Event()

    def hold_locks() -> None:
        with engine.connect() as conn, conn.begin():
            conn.execute(text("LOCK TABLE calibrations, jobs, api_keys IN ACCESS EXCLUSIVE MODE"))
            locked.set()
            release.wait(10)

    def write(i: int) -> int:
        with httpx.Client(base_url=base, headers=auth, timeout=30) as c:
            if i % 5 == 1:
                r = c.post("/v1/calibrations", content=body, headers={"Content-Type": "text/plain"})
            elif i % 5 == 2:
                r = c.post(f"/v1/jobs/{job_id}/cancel")
            elif i % 5 == 3:
                r = c.post("/v1/webhooks/secret/rotate")
            elif i % 5 == 4:
                r = c.post(f"/v1/jobs/{job_id}/artifacts/native/link")
            else:
                r = c.post("/v1/jobs", json={"model": {"id": "tiny"}, "target": {"bits": 4}})
            return r.status_code

    holder = threading.Thread(target=hold_locks, daemon=True)
    holder.start()
    try:
        assert locked.wait(10)
        with ThreadPoolExecutor(10) as pool:
            writes = [pool.submit(write, i) for i in range(10)]
            time.sleep(0.5)  # the writes are waiting on the locks now
            took = []
            t_end = time.monotonic() + 3
            with httpx.Client(base_url=base, timeout=30) as c:
                while time.monotonic() < t_end:
                    t0 = time.perf_counter()
                    assert c.get("/healthz").status_code == 200
                    took.append(time.perf_counter() - t0)
                    time.sleep(0.1)
            slowest = max(took)
            assert slowest < 0.5, f"/healthz took up to {slowest:.2f} s while writes waited"
            assert not any(w.done() for w in writes), "the writes did not wait on the locks"
            release.set()
            statuses = [w.result() for w in writes]
    finally:
        release.set()
        holder.join(10)
        engine.dispose()
    # submit, upload, cancel (the queued job; then 409 once cancelled), rotate, link (no
    # artifact of a cancelled job: 404), twice
    assert statuses[0] == statuses[5] == 202 and statuses[1] == statuses[6] == 201, statuses
    assert sorted([statuses[2], statuses[7]]) == [200, 409], statuses
    assert statuses[3] == statuses[8] == 200 and statuses[4] == statuses[9] == 404, statuses
