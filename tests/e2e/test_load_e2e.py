"""The API under load, real processes on PostgreSQL: uvicorn with 2 worker processes (uvloop +
httptools, as compose runs it), 200 concurrent pollers (each asking again POLL_INTERVAL_S
after an answer) plus 30 slow downloads plus 30 open event streams for LOAD_S seconds. No request may fail and none may take more than a few
seconds; the slow downloads and the streams must still be open at the end (they hold no
database connection, so they cannot starve the pollers)."""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from typing import Any

import httpx
import pytest

from app.artifacts.manifest import artifact_row
from app.db.session import create_db_engine, session_factory
from app.jobs import state
from app.keys.service import find_key
from devtools.stack import Stack
from tests.app.factories import make_job

pytestmark = pytest.mark.slow

POLLERS = 200
SLOW_DOWNLOADS = 30
STREAMS = 30
LOAD_S = 20.0
# Each poller asks again this long after an answer (a client following a job, not a flood:
# the service benchmark measures flat-out throughput).
POLL_INTERVAL_S = 0.5
# "No request slower than a few seconds": on this 2-core machine clients and servers share
# the CPUs, so the bound is generous; a starved pool would show as 503s or 10 s+ waits.
MAX_LATENCY_S = 5.0
FILE_BYTES = 8 * 1024 * 1024


def prepare(stack: Stack, key: str, claim_queued: bool = False) -> tuple[str, str]:
    """(succeeded job with an 8 MiB artifact file, queued job) of the key, written directly;
    with `claim_queued` the second job is running (claimed), so that a worker beside the API
    leaves it alone and its event streams stay open."""
    url = stack.env.get("HIGGS_DATABASE_URL") or f"sqlite:///{stack.data_dir / 'higgs.db'}"
    engine = create_db_engine(url)
    try:
        sessions = session_factory(engine)
        with sessions() as s:
            key_id = find_key(s, key).id
            done = make_job(s, key_id)
            queued = make_job(s, key_id)
        store = stack.tmp / "store" / done.id / "native"
        store.mkdir(parents=True)
        (store / "model.safetensors").write_bytes(b"\x02" * FILE_BYTES)
        (store / "config.json").write_text('{"model_type": "llama"}')
        with sessions() as s:
            state.claim(s, done.id, "w")
            state.succeed(s, done.id, {"layers": []}, [], [artifact_row("native", store)])
            if claim_queued:
                state.claim(s, queued.id, "w")
        return done.id, queued.id
    finally:
        engine.dispose()


class SlowClient:
    """Reads a response a few hundred bytes at a time through a tiny receive buffer."""

    def __init__(self, url: str, path: str, key: str) -> None:
        self.url, self.path, self.key = url, path, key
        self.status = 0
        self.received = 0
        self.closed = False
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, self.writer = await asyncio.open_connection(sock=sock, limit=4096)
        self.writer.write(
            f"GET {self.path} HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {self.key}\r\n\r\n".encode()
        )
        await self.writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        self.status = int(head.split(b" ", 2)[1])
        self.reader = reader

    async def trickle(self, until: float) -> None:
        while time.monotonic() < until:
            try:
                chunk = await asyncio.wait_for(self.reader.read(256), 0.2)
            except TimeoutError:
                continue
            if not chunk:
                self.closed = True
                return
            self.received += len(chunk)
            await asyncio.sleep(0.1)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class KeepAliveClient:
    """One kept-alive HTTP/1.1 connection with the request written and the answer read by hand
    (status line, Content-Length, body). An httpx request costs this test's process about a
    millisecond of CPU, so 200 httpx pollers on a 2-core machine shared with the server
    measured the client; this costs a fraction of that."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.head = f"Host: {self.host}\r\n{extra}\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> tuple[int, bytes]:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        reader = self.reader
        self.writer.write(f"GET {path} HTTP/1.1\r\n{self.head}".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {
            k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])
        }
        body = await reader.readexactly(int(fields.get("content-length", "0")))
        if fields.get("connection", "").lower() == "close":
            self.close()
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def poller(
    c: KeepAliveClient,
    paths: list[str],
    until: float,
    lat: list[float],
    errors: list[str],
    retries: list[str],
    interval_s: float = POLL_INTERVAL_S,
) -> None:
    i = 0
    while time.monotonic() < until:
        path = paths[i % len(paths)]
        i += 1
        t0 = time.perf_counter()
        try:
            try:
                status, body = await c.get(path)
            except (asyncio.IncompleteReadError, ConnectionError):
                # A kept-alive connection the server closed as this request went out: an
                # idempotent GET is sent again on a new one (RFC 9112 section 9.3.1), once.
                retries.append(path)
                c.close()
                status, body = await c.get(path)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            errors.append(f"{path}: {type(e).__name__}")
            c.close()
            continue
        lat.append(time.perf_counter() - t0)
        if status != 200:
            errors.append(f"{path}: {status} {body[:200]!r}")
        await asyncio.sleep(interval_s)


async def ceiling_rps(url: str, clients: int = 50, seconds: float = 2.0) -> float:
    """Requests/s of the hello-world endpoint (GET /healthz) on this server right now, with the
    pollers' own client: what the machine, shared with other work, lets any endpoint reach."""
    done = 0
    until = time.monotonic() + seconds
    conns = [KeepAliveClient(url) for _ in range(clients)]

    async def loop(c: KeepAliveClient) -> None:
        nonlocal done
        while time.monotonic() < until:
            if (await c.get("/healthz"))[0] == 200:
                done += 1

    try:
        await asyncio.gather(*(loop(c) for c in conns))
    finally:
        for c in conns:
            c.close()
    return done / seconds


async def run_load(
    url: str,
    key: str,
    done: str,
    queued: str,
    interval_s: float = POLL_INTERVAL_S,
    load_s: float = LOAD_S,
) -> dict[str, Any]:
    slow = [
        SlowClient(url, f"/v1/jobs/{done}/artifacts/native/files/model.safetensors", key)
        for _ in range(SLOW_DOWNLOADS)
    ]
    slow += [SlowClient(url, f"/v1/jobs/{queued}/events", key) for _ in range(STREAMS)]
    await asyncio.gather(*(s.open() for s in slow))
    until = time.monotonic() + load_s
    lat: list[float] = []
    errors: list[str] = []
    retries: list[str] = []
    paths = [f"/v1/jobs/{queued}", f"/v1/jobs/{done}", "/v1/jobs?limit=5"]
    trickles = [asyncio.create_task(s.trickle(until)) for s in slow]
    conns = [KeepAliveClient(url, {"Authorization": f"Bearer {key}"}) for _ in range(POLLERS)]
    try:
        await asyncio.gather(
            *(poller(p, paths, until, lat, errors, retries, interval_s) for p in conns)
        )
    finally:
        for p in conns:
            p.close()
    await asyncio.gather(*trickles)
    async with httpx.AsyncClient(timeout=30) as c:
        ready = (await c.get(f"{url}/readyz")).status_code
    for s in slow:
        s.close()
    return {"slow": slow, "lat": lat, "errors": errors, "ready": ready, "retries": retries}


def test_200_pollers_30_slow_downloads_30_streams(stack_factory: Any) -> None:
    stack = stack_factory("redis-postgres")
    # One key is the whole load here: no per-key request rate limit or stream cap.
    stack.env.update(
        {
            "HIGGS_RATE_LIMIT_PER_S": "0",
            "HIGGS_MAX_EVENT_STREAMS_PER_KEY": "0",
            "HIGGS_EVENTS_POLL_INTERVAL_S": "0.5",
        }
    )
    stack.migrate()
    stack.start_api(workers=2, timeout=90)
    key = stack.create_key("load")
    done, queued = prepare(stack, key)
    ceiling = asyncio.run(ceiling_rps(stack.url))
    out = asyncio.run(run_load(stack.url, key, done, queued))
    lat, errors, slow = out["lat"], out["errors"], out["slow"]
    assert [s.status for s in slow] == [200] * len(slow)
    assert errors == [], errors[:20]
    assert out["ready"] == 200
    lat.sort()
    summary = (
        f"{len(lat)} requests in {LOAD_S:g} s ({len(lat) / LOAD_S:.0f}/s), "
        f"p50 {1000 * statistics.median(lat):.0f} ms, "
        f"p99 {1000 * lat[int(0.99 * (len(lat) - 1))]:.0f} ms, max {1000 * lat[-1]:.0f} ms, "
        f"{len(out['retries'])} resent on a closed keep-alive connection"
    )
    print(summary)
    assert len(lat) > POLLERS, summary  # every poller got answers, not just one each
    # The downloads progressed and were never cut; the streams are still open.
    downloads, streams = slow[:SLOW_DOWNLOADS], slow[SLOW_DOWNLOADS:]
    assert all(not s.closed and 0 < s.received < FILE_BYTES for s in downloads)
    assert all(not s.closed for s in streams)
    offered = POLLERS / POLL_INTERVAL_S
    if ceiling < offered:
        # Even a hello-world endpoint cannot serve the offered load on this machine now (other
        # work holds the CPUs): latency would measure the machine, not the service.
        pytest.skip(
            f"latency not judged: hello-world ceiling {ceiling:.0f} req/s < offered "
            f"{offered:.0f} req/s ({summary}; no errors, streams and downloads held)"
        )
    assert lat[-1] < MAX_LATENCY_S, f"{summary}; hello-world ceiling {ceiling:.0f} req/s"


# The embedded default under the crowd with pollers that ask again at once: its p99 is at most
# this many times its p50 (requests served in turn, app/admission.py, rather than most quick
# and a few waiting for seconds: without the queue it was 6 to 7 times), and under 2 s when the
# machine can serve the crowd at all.
EMBEDDED_TAIL = 4.0
EMBEDDED_P99_S = 2.0
EMBEDDED_LOAD_S = 10.0


def test_embedded_default_under_the_same_crowd(stack_factory: Any) -> None:
    """`higgs serve` as a user starts it (one API process, SQLite, the filesystem broker, its
    worker) under 200 pollers asking again as soon as they are answered, 30 slow downloads and
    30 streams: no errors, a short tail, and a p99 under EMBEDDED_P99_S."""
    stack = stack_factory("local")
    stack.env.update(
        {
            "HIGGS_RATE_LIMIT_PER_S": "0",
            "HIGGS_MAX_EVENT_STREAMS_PER_KEY": "0",
            "HIGGS_EVENTS_POLL_INTERVAL_S": "0.5",
            "HIGGS_HEARTBEAT_TIMEOUT_S": "3600",  # the followed job stays running
        }
    )
    stack.migrate()
    key = stack.create_key("load")
    done, running = prepare(stack, key, claim_queued=True)
    stack.start_serve()
    ceiling = asyncio.run(ceiling_rps(stack.url))
    out = asyncio.run(run_load(stack.url, key, done, running, 0.0, EMBEDDED_LOAD_S))
    lat, errors, slow = out["lat"], out["errors"], out["slow"]
    assert [s.status for s in slow] == [200] * len(slow)
    assert errors == [], errors[:20]
    lat.sort()
    p50, p99 = statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]
    summary = (
        f"{len(lat)} requests in {EMBEDDED_LOAD_S:g} s ({len(lat) / EMBEDDED_LOAD_S:.0f}/s), "
        f"p50 {1000 * p50:.0f} ms, p99 {1000 * p99:.0f} ms, max {1000 * lat[-1]:.0f} ms, "
        f"hello-world ceiling {ceiling:.0f} req/s"
    )
    print(summary)
    assert all(not s.closed for s in slow[SLOW_DOWNLOADS:]), "an event stream ended"
    assert p99 <= EMBEDDED_TAIL * p50, summary
    if ceiling < POLLERS / POLL_INTERVAL_S:
        pytest.skip(f"p99 bound not judged: the machine is busy ({summary}); tail judged")
    assert p99 < EMBEDDED_P99_S, summary
