#!/usr/bin/env python
"""Service benchmark: the API against its hello-world ceiling, queue latency and where a real
job's time goes.

1. API: a hello-world endpoint (GET /healthz, same server and settings) beside GET job, the
   job list and submit, each with 10/50/100/200 concurrent clients for `--duration` seconds,
   against uvicorn with 2 worker processes (uvloop + httptools), on SQLite (the embedded
   default) and on PostgreSQL (when --postgres-url or HIGGS_TEST_POSTGRES_URL is given).
   Throughput and p50 / p99 latency, and each as a fraction of the ceiling at the same client
   count; the PostgreSQL targets (GET job >= 1,000 req/s with p99 < 100 ms at 50 clients, no
   collapse at 200) are judged from the measured rows.
2. Queue latency: time from submit (job created_at) to the worker starting it (started_at),
   over several tiny jobs on the embedded default (SQLite + filesystem broker).
3. A real job: SmolLM2-135M (data/smollm2-135m, prepared by scripts/prepare_data.py) at 4 bits,
   time per stage, and the service overhead = (finished_at - created_at) - the engine's own
   total time (report.json timings), as a share of the engine time (target < 10%).

Load generator for part 1: wrk (native; `apt-get install wrk`) when it is on PATH, else a
Python asyncio client (httpx), which on a small machine caps the figures itself; the JSON
records which one ran. --client-cpus / --server-cpus pin wrk and the uvicorn processes to
CPU sets (taskset lists) so that they do not compete for the same core.

Everything runs as real processes (uvicorn, Celery worker) on this machine; the clients share
it with the server. Writes benchmarks/results/service.json + .md (--api-only: part 1 alone, to
results/service_api.json + .md; --stem names other files for a trial run).

--noisy: only the noisy-neighbour rows, to results/service_noisy.json + .md: one key holds 40
event-stream requests and 10 slow 8 MiB downloads open while another key polls GET job; the
second key's p50/p99 beside its solo figures (goal: p99 within 2x of solo). SQLite, and
PostgreSQL + Redis (--redis-url or HIGGS_TEST_REDIS_URL) when a PostgreSQL URL is given.

Usage: python -m benchmarks.service_bench [--duration 4] [--jobs 5] [--postgres-url URL]
                                          [--skip-model] [--api-only] [--generator auto]
                                          [--client-cpus 1] [--server-cpus 0]
                                          [--clients 10,50,100,200] [--no-sqlite] [--stem S]
                                          [--noisy] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from devtools.scratch import scratch_postgres
from devtools.stack import Stack

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SMOLLM = REPO / "data" / "smollm2-135m"


# ---------------------------------------------------------------- processes


def make_stack(root: Path, env_extra: dict[str, str]) -> Stack:
    """API + worker processes sharing one environment, as in the e2e tests (devtools/stack.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIGGS_")}
    env.update(
        {"HIGGS_DATA_DIR": str(root / "data"), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    )
    env.update(env_extra)
    return Stack(tmp=root, env=env)


def tiny_model(dest: Path) -> None:
    """A random 2-layer Llama (the e2e tests' size) for the queue-latency jobs."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(dest), safe_serialization=True)


# ---------------------------------------------------------------- 1. API against its ceiling

CLIENT_COUNTS = (10, 50, 100, 200)
LIST_PAGE = 20
SUBMIT_BODY = {"model": {"id": "tiny"}, "target": {"bits": 4}}


def endpoints(job_id: str) -> list[tuple[str, str, str]]:
    """(name, method, path): the hello-world ceiling first, then the API's hot paths."""
    return [
        ("hello world (GET /healthz)", "GET", "/healthz"),
        ("GET job", "GET", f"/v1/jobs/{job_id}"),
        (f"job list (GET /v1/jobs?limit={LIST_PAGE})", "GET", f"/v1/jobs?limit={LIST_PAGE}"),
        ("submit (POST /v1/jobs)", "POST", "/v1/jobs"),
    ]


# wrk's Lua hooks: the request (method, headers, body) and, when the run is done, one line of
# JSON with the counts and latency percentiles (microseconds) from wrk's own histogram.
WRK_LUA = """
wrk.method = {method}
wrk.headers["Authorization"] = {auth}
{body}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK_JSON {{\\"requests\\": %d, \\"duration_us\\": %d, \\"connect\\": %d, \\"read\\": %d, " ..
    "\\"write\\": %d, \\"status\\": %d, \\"timeout\\": %d, \\"p50_us\\": %d, \\"p99_us\\": %d, " ..
    "\\"max_us\\": %d}}\\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.max))
end
"""


def _lua(key: str, method: str) -> str:
    body = ""
    if method == "POST":
        body = (
            f"wrk.body = {json.dumps(json.dumps(SUBMIT_BODY))}\n"
            'wrk.headers["Content-Type"] = "application/json"'
        )
    return WRK_LUA.format(method=json.dumps(method), auth=json.dumps(f"Bearer {key}"), body=body)


def _taskset(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


def _wrk(
    url: str,
    key: str,
    method: str,
    path: str,
    clients: int,
    duration: float,
    cpus: str | None,
    record: bool = True,
) -> dict[str, Any]:
    """One wrk run: `clients` connections, one wrk thread per CPU it may use (at most
    `clients`), latency percentiles from wrk's own histogram (a Lua `done` hook prints them)."""
    threads = max(1, min(clients, len(cpus.split(",")) if cpus else os.cpu_count() or 1))
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as fh:
        fh.write(_lua(key, method))
        script = fh.name
    try:
        argv = [
            *_taskset(cpus),
            "wrk",
            f"-t{threads}",
            f"-c{clients}",
            f"-d{max(1, round(duration))}s",
            "--timeout",
            "30s",
            "--latency",
            "-s",
            script,
            url + path,
        ]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 120)
    finally:
        os.unlink(script)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRK_JSON ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout}\n{out.stderr}")
    w = json.loads(line.removeprefix("WRK_JSON "))
    wall = w["duration_us"] / 1e6
    # Non-2xx/3xx answers are errors, not throughput; socket errors are counted by kind.
    errors = {k: w[k] for k in ("status", "timeout", "connect", "read", "write") if w[k] and record}
    if "status" in errors:
        errors["non-2xx/3xx"] = errors.pop("status")
    ok = w["requests"] - w["status"]
    return {
        "clients": clients,
        "duration_s": round(wall, 3),
        "requests": ok,
        "errors": errors,
        "throughput_rps": round(ok / wall, 1) if wall else 0.0,
        "p50_ms": round(w["p50_us"] / 1000, 2),
        "p99_ms": round(w["p99_us"] / 1000, 2),
        "max_ms": round(w["max_us"] / 1000, 2),
        "wrk_threads": threads,
    }


def start_nibbling(
    readers: list[SlowReader], stop: threading.Event
) -> tuple[dict[str, int], threading.Thread]:
    """How many `readers` got each HTTP status; then a daemon thread reads a little from each,
    every 50 ms, until `stop` is set (slow clients that hold their responses open); and that
    thread."""
    statuses: dict[str, int] = {}
    for r in readers:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1

    def nibble_all() -> None:
        while not stop.is_set():
            for r in readers:
                r.nibble()
            time.sleep(0.05)

    nibbler = threading.Thread(target=nibble_all, daemon=True)
    nibbler.start()
    return statuses, nibbler


def load(
    generator: str,
    url: str,
    key: str,
    method: str,
    path: str,
    clients: int,
    duration: float,
    cpus: str | None,
) -> dict[str, Any]:
    """One row: a 1 s warm-up (every connection open, every worker's pools filled), then
    `duration` seconds measured, with wrk or the Python asyncio client."""
    if generator == "wrk":
        _wrk(url, key, method, path, clients, 1.0, cpus, record=False)
        return _wrk(url, key, method, path, clients, duration, cpus)
    return asyncio.run(_load(url, key, method, path, clients, duration))


async def _load(
    url: str, key: str, method: str, path: str, clients: int, duration: float
) -> dict[str, Any]:
    """`clients` concurrent request loops over one shared client (one connection each: building
    an httpx client per loop costs an SSL context each and stalls the event loop)."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    lat: list[float] = []
    errors: dict[str, int] = {}
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=60
    ) as c:

        async def loop(stop_at: float, record: bool) -> None:
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                try:
                    r = await c.request(
                        method, path, json=SUBMIT_BODY if method == "POST" else None
                    )
                    code = str(r.status_code) if r.status_code >= 400 else ""
                except httpx.HTTPError as e:
                    code = type(e).__name__
                if not record:
                    continue
                if code:
                    errors[code] = errors.get(code, 0) + 1
                else:
                    lat.append(time.perf_counter() - t0)

        # Warm-up: every connection open, every uvicorn worker's pools filled.
        await asyncio.gather(*[loop(time.perf_counter() + 1.0, False) for _ in range(clients)])
        t0 = time.perf_counter()
        await asyncio.gather(*[loop(t0 + duration, True) for _ in range(clients)])
        wall = time.perf_counter() - t0
    lat.sort()

    def pct(p: float) -> float:  # nearest-rank percentile; 0 when nothing was answered
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else 0.0

    return {
        "clients": clients,
        "duration_s": round(wall, 3),
        "requests": len(lat),
        "errors": errors,
        "throughput_rps": round(len(lat) / wall, 1),
        "p50_ms": round(pct(0.50) * 1000, 2),
        "p99_ms": round(pct(0.99) * 1000, 2),
        "max_ms": round(lat[-1] * 1000, 2) if lat else None,
    }


def pin_group(pgid: int, cpus: str) -> list[int]:
    """Pin every process of process group `pgid` (uvicorn's supervisor and its workers) to
    `cpus` ("0" or "0,1"); returns the pids pinned."""
    allowed = {int(c) for c in cpus.split(",")}
    pinned = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # after the command: state, ppid, pgrp
            pid = int(stat.parent.name)
            try:
                os.sched_setaffinity(pid, allowed)
            except OSError:
                continue
            pinned.append(pid)
    return pinned


def bench_api(
    backend: str,
    db_url: str | None,
    duration: float,
    generator: str = "python",
    client_cpus: str | None = None,
    server_cpus: str | None = None,
    client_counts: tuple[int, ...] = CLIENT_COUNTS,
) -> dict[str, Any]:
    """Every endpoint at every client count against one uvicorn (2 workers, uvloop + httptools:
    `higgs serve` and compose's settings), each row also as a fraction of the hello-world
    ceiling measured in the same run at the same client count."""
    root = Path(tempfile.mkdtemp(prefix=f"higgs-bench-{backend}-"))
    (root / "models" / "tiny").mkdir(parents=True)  # validated by name only: no job runs
    env = {
        "HIGGS_MODELS_DIR": str(root / "models"),
        # The benchmark is one key flat out: no per-key rate limit or job quota.
        "HIGGS_RATE_LIMIT_PER_S": "0",
        "HIGGS_MAX_ACTIVE_JOBS_PER_KEY": "0",
    }
    if db_url:
        env["HIGGS_DATABASE_URL"] = db_url
    stack = make_stack(root, env)
    rows: list[dict[str, Any]] = []
    try:
        stack.migrate()
        api = stack.start_api(workers=2, timeout=90)
        if server_cpus:
            pin_group(api.popen.pid, server_cpus)  # spawned in its own session: pgid == pid
        key = stack.create_key("bench")
        # LIST_PAGE jobs before any row, so that every job-list row returns a full page (the
        # submit rows add more as the run goes on); GET job asks for the first one.
        with httpx.Client(
            base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as c:
            ids = []
            for _ in range(LIST_PAGE):
                r = c.post("/v1/jobs", json=SUBMIT_BODY)
                r.raise_for_status()
                ids.append(r.json()["id"])
        job_id = ids[0]
        for clients in client_counts:
            ceiling: dict[str, Any] | None = None
            for name, method, path in endpoints(job_id):
                res = load(generator, stack.url, key, method, path, clients, duration, client_cpus)
                res.update({"backend": backend, "endpoint": name})
                if ceiling is None:
                    ceiling = res
                res["throughput_of_ceiling"] = (
                    round(res["throughput_rps"] / ceiling["throughput_rps"], 3)
                    if ceiling["throughput_rps"]
                    else None
                )
                res["p50_vs_ceiling"] = (
                    round(res["p50_ms"] / ceiling["p50_ms"], 2) if ceiling["p50_ms"] else None
                )
                res["p99_vs_ceiling"] = (
                    round(res["p99_ms"] / ceiling["p99_ms"], 2) if ceiling["p99_ms"] else None
                )
                rows.append(res)
                print(
                    f"{backend} {clients:>3} clients {name:<34} {res['throughput_rps']:>8} req/s "
                    f"p50 {res['p50_ms']} ms p99 {res['p99_ms']} ms errors {res['errors']}",
                    flush=True,
                )
    finally:
        stack.close()
    return {
        "backend": backend,
        "uvicorn_workers": 2,
        "generator": generator,
        "client_cpus": client_cpus,
        "server_cpus": server_cpus,
        "rows": rows,
    }


# ---------------------------------------------------------------- 1b. noisy neighbour

NOISY_FILE_BYTES = 8 * 1024 * 1024


class SlowReader:
    """A raw HTTP/1.1 GET read a few bytes at a time with a tiny receive buffer (like
    `curl --limit-rate`): the server really waits on it."""

    def __init__(self, base: str, path: str, key: str) -> None:
        import socket

        host, port = base.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(30)
        self.sock.connect((host, int(port)))
        self.sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1024)
            if not chunk:
                break
            head += chunk
        self.status = int(head.split(b" ", 2)[1]) if head else 0
        self.received = len(head)
        self.sock.settimeout(0.02)

    def nibble(self) -> None:
        with contextlib.suppress(OSError):
            self.received += len(self.sock.recv(512))

    def close(self) -> None:
        self.sock.close()


def bench_noisy(
    backend: str,
    db_url: str | None,
    broker_url: str | None,
    duration: float,
    clients: int = 4,
    streams: int = 40,
    downloads: int = 10,
) -> dict[str, Any]:
    """One key ("quiet") polls GET job with `clients` loops, alone and then while another key
    ("noisy") holds `streams` event-stream requests and `downloads` slow 8 MiB downloads open,
    against uvicorn with 2 workers, no request rate limit and the default stream cap. Reports
    the quiet key's p50/p99 and throughput both ways (goal: p99 with the neighbour within 2x
    of solo)."""
    from app.artifacts.manifest import artifact_row
    from app.db.session import create_db_engine, session_factory
    from app.jobs import state
    from app.keys.service import find_key

    root = Path(tempfile.mkdtemp(prefix=f"higgs-noisy-{backend}-"))
    (root / "models" / "tiny").mkdir(parents=True)
    # The quiet key polls flat out: no request rate limit (it would answer most of its polls
    # 429 and leave only the allowed ones to time). The stream cap stays at its default.
    env = {"HIGGS_MODELS_DIR": str(root / "models"), "HIGGS_RATE_LIMIT_PER_S": "0"}
    if db_url:
        env["HIGGS_DATABASE_URL"] = db_url
    if broker_url:
        env["HIGGS_BROKER_URL"] = broker_url
    stack = make_stack(root, env)
    readers: list[SlowReader] = []
    stop = threading.Event()
    try:
        stack.migrate()
        stack.start_api(workers=2, timeout=90)
        quiet, noisy = stack.create_key("quiet"), stack.create_key("noisy")
        ids: dict[str, list[str]] = {}
        for name, key, n in (("quiet", quiet, 1), ("noisy", noisy, 2)):
            with stack.client(key) as c:
                ids[name] = [c.post("/v1/jobs", json=SUBMIT_BODY).json()["id"] for _ in range(n)]
        done, running = ids["noisy"]
        store = root / "store" / done / "native"
        store.mkdir(parents=True)
        (store / "model.safetensors").write_bytes(b"\x01" * NOISY_FILE_BYTES)
        engine = create_db_engine(db_url or f"sqlite:///{root / 'data' / 'higgs.db'}")
        try:
            with session_factory(engine)() as s:
                find_key(s, noisy)  # the key exists in this database
                state.claim(s, done, "bench")
                state.succeed(s, done, {"layers": []}, [], [artifact_row("native", store)])
                state.claim(s, running, "bench")
        finally:
            engine.dispose()
        path = f"/v1/jobs/{ids['quiet'][0]}"
        solo = load("python", stack.url, quiet, "GET", path, clients, duration, None)
        readers = [
            SlowReader(stack.url, f"/v1/jobs/{running}/events", noisy) for _ in range(streams)
        ]
        file_path = f"/v1/jobs/{done}/artifacts/native/files/model.safetensors"
        readers += [SlowReader(stack.url, file_path, noisy) for _ in range(downloads)]
        statuses, nibbler = start_nibbling(readers, stop)
        busy = load("python", stack.url, quiet, "GET", path, clients, duration, None)
        stop.set()
        nibbler.join(5)
    finally:
        stop.set()
        for r in readers:
            r.close()
        stack.close()
    ratio = round(busy["p99_ms"] / solo["p99_ms"], 2) if solo["p99_ms"] else None
    out = {
        "backend": backend,
        "uvicorn_workers": 2,
        "quiet_clients": clients,
        "noisy_stream_requests": streams,
        "noisy_slow_downloads": downloads,
        "noisy_statuses": statuses,
        "solo": solo,
        "with_neighbour": busy,
        "p99_ratio": ratio,
        "goal_p99_within_2x": ratio is not None and ratio <= 2.0,
    }
    print(
        f"noisy neighbour {backend}: quiet p50 {solo['p50_ms']} -> {busy['p50_ms']} ms, "
        f"p99 {solo['p99_ms']} -> {busy['p99_ms']} ms ({ratio}x); noisy statuses {statuses}",
        flush=True,
    )
    return out


def _noisy_md(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Noisy neighbour: one key's open streams and slow downloads vs another key's polling",
        "",
        'Key "noisy" holds event-stream requests and slow 8 MiB downloads open (read a few '
        'hundred bytes every 50 ms); key "quiet" polls GET job flat out. uvicorn with 2 '
        "workers, no request rate limit (HIGGS_RATE_LIMIT_PER_S = 0), the default stream cap "
        "(HIGGS_MAX_EVENT_STREAMS_PER_KEY = 10 per process).",
        "",
        "| backend | noisy: streams / downloads (statuses) | quiet clients | solo req/s, p50 / "
        "p99 ms | with neighbour req/s, p50 / p99 ms | p99 ratio | goal (<= 2x) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['backend']} | skipped: {r['skipped']} | | | | | |")
            continue
        s, b = r["solo"], r["with_neighbour"]
        lines.append(
            f"| {r['backend']} | {r['noisy_stream_requests']} / {r['noisy_slow_downloads']} "
            f"({', '.join(f'{k}: {v}' for k, v in sorted(r['noisy_statuses'].items()))}) "
            f"| {r['quiet_clients']} | {s['throughput_rps']}, {s['p50_ms']} / {s['p99_ms']} "
            f"| {b['throughput_rps']}, {b['p50_ms']} / {b['p99_ms']} | {r['p99_ratio']}x "
            f"| {'met' if r['goal_p99_within_2x'] else 'NOT met'} |"
        )
    return lines


def verdict(api: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets on PostgreSQL: GET job >= 1,000 req/s with p99 < 100 ms at 50 clients; no
    collapse at 200 clients (throughput at 200 at least half of that at 50, no errors)."""
    pg = next((b for b in api if b.get("backend") == "postgresql" and "rows" in b), None)
    if pg is None:
        return {"measured": False}
    get = {r["clients"]: r for r in pg["rows"] if r["endpoint"] == "GET job"}
    at50, at200 = get.get(50), get.get(200)
    if at50 is None or at200 is None:
        return {"measured": False}
    return {
        "measured": True,
        "get_job_50_rps": at50["throughput_rps"],
        "get_job_50_p99_ms": at50["p99_ms"],
        "target_1000_rps_p99_100ms_met": at50["throughput_rps"] >= 1000 and at50["p99_ms"] < 100,
        "get_job_200_rps": at200["throughput_rps"],
        "get_job_200_errors": at200["errors"],
        "no_collapse_at_200": not at200["errors"]
        and at200["throughput_rps"] >= 0.5 * at50["throughput_rps"],
    }


# ---------------------------------------------------------------- 2 + 3. jobs


def _ts(s: str) -> datetime:
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


def _wait(c: httpx.Client, job_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = c.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise RuntimeError(f"job {job_id} did not finish in {timeout}s")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def bench_jobs(n_jobs: int, with_model: bool) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="higgs-bench-jobs-"))
    models = root / "models"
    models.mkdir()
    tiny_model(models / "tiny")
    model_note = ""
    if with_model and (SMOLLM / "config.json").is_file():
        # Copied in (hard links where the file system allows): the service refuses a local
        # model that links outside its models folder.
        shutil.copytree(SMOLLM, models / "smollm2-135m", copy_function=_link_or_copy)
    elif with_model:
        model_note = (
            f"{SMOLLM} is not prepared (python scripts/prepare_data.py); real-model part skipped"
        )
    stack = make_stack(root, {"HIGGS_MODELS_DIR": str(models)})
    out: dict[str, Any] = {}
    try:
        stack.migrate()
        stack.start_api(workers=1, timeout=90)
        stack.start_worker(log_level="WARNING")
        key = stack.create_key("bench")
        with httpx.Client(
            base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        ) as c:
            body = {"model": {"id": "tiny"}, "target": {"bits": 4}}
            _wait(c, c.post("/v1/jobs", json=body).json()["id"], 300)  # warm-up (worker start)
            waits, totals = [], []
            for _ in range(n_jobs):
                time.sleep(1.0)  # an idle worker, as a user would find it
                job = _wait(c, c.post("/v1/jobs", json=body).json()["id"], 300)
                if job["status"] != "succeeded":
                    raise RuntimeError(f"tiny job failed: {job.get('error')}")
                waits.append((_ts(job["started_at"]) - _ts(job["created_at"])).total_seconds())
                totals.append((_ts(job["finished_at"]) - _ts(job["created_at"])).total_seconds())
            out["queue_latency"] = {
                "jobs": n_jobs,
                "submit_to_start_s": {
                    "median": round(statistics.median(waits), 4),
                    "max": round(max(waits), 4),
                    "all": [round(w, 4) for w in waits],
                },
                "tiny_job_total_s": {"median": round(statistics.median(totals), 4)},
                "broker": "filesystem (embedded default)",
                "database": "sqlite",
            }
            if with_model and not model_note:
                out["real_model"] = _real_job(c)
            elif model_note:
                out["real_model"] = {"skipped": model_note}
    finally:
        stack.close()
    return out


def _real_job(c: httpx.Client) -> dict[str, Any]:
    body = {"model": {"id": "smollm2-135m"}, "target": {"bits": 4}}
    t0 = time.perf_counter()
    job_id = c.post("/v1/jobs", json=body).json()["id"]
    job = _wait(c, job_id, 3600)
    client_s = time.perf_counter() - t0
    if job["status"] != "succeeded":
        return {"failed": job.get("error")}
    report = c.get(f"/v1/jobs/{job_id}/report").json()
    engine = report["timings"]
    engine_total = float(engine["total"])
    server_total = (_ts(job["finished_at"]) - _ts(job["created_at"])).total_seconds()
    queue_wait = (_ts(job["started_at"]) - _ts(job["created_at"])).total_seconds()
    overhead = server_total - engine_total
    return {
        "model": "SmolLM2-135M (data/smollm2-135m)",
        "target_bits": 4,
        "bits_per_weight": job["summary"]["bits_per_weight"],
        "engine_timings_s": {k: round(float(v), 3) for k, v in engine.items()},
        "service_stage_durations_s": job.get("stage_durations"),
        "submit_to_start_s": round(queue_wait, 3),
        "server_total_s": round(server_total, 3),
        "client_observed_total_s": round(client_s, 3),
        "engine_total_s": round(engine_total, 3),
        "service_overhead_s": round(overhead, 3),
        "service_overhead_share": round(overhead / engine_total, 4),
        "target_share": 0.10,
        "meets_target": overhead / engine_total < 0.10,
        "device": (report.get("metrics") or {}).get("device"),  # recorded by the engine
    }


# ---------------------------------------------------------------- report


def _api_md(results: dict[str, Any]) -> list[str]:
    lines = [
        "## API throughput and latency against the hello-world ceiling",
        "",
        "uvicorn --workers 2 with uvloop + httptools (as `higgs serve` and compose run it); "
        f"{results['duration_s']:g} s per row after a 1 s warm-up. {_generator_md(results)} "
        "`of ceiling` = throughput / hello-world throughput at the same client count; "
        "errors are non-2xx answers and socket errors, not counted in req/s.",
        "",
        "| backend | clients | endpoint | req/s | of ceiling | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in results["api"]:
        if "skipped" in b:
            lines.append(f"| {b['backend']} | skipped: {b['skipped']} | | | | | | |")
            continue
        for r in b["rows"]:
            lines.append(
                f"| {r['backend']} | {r['clients']} | {r['endpoint']} | {r['throughput_rps']} | "
                f"{r['throughput_of_ceiling']} | {r['p50_ms']} | {r['p99_ms']} | "
                f"{sum(r['errors'].values()) or 0} |"
            )
    v = results.get("verdict", {})
    if v.get("measured"):
        lines += [
            "",
            f"Target on PostgreSQL, GET job at 50 clients >= 1,000 req/s with p99 < 100 ms: "
            f"{v['get_job_50_rps']} req/s, p99 {v['get_job_50_p99_ms']} ms -> "
            f"{'met' if v['target_1000_rps_p99_100ms_met'] else 'NOT met'}.",
            f"No collapse at 200 clients (no errors, throughput at least half of 50 clients'): "
            f"{v['get_job_200_rps']} req/s, errors {v['get_job_200_errors'] or 'none'} -> "
            f"{'met' if v['no_collapse_at_200'] else 'NOT met'}.",
        ]
    return lines


def _generator_md(results: dict[str, Any]) -> str:
    """Which load generator ran and what was pinned where."""
    if results.get("generator", "python") == "python":
        text = (
            "Load generator: one Python asyncio client process (httpx) on the same machine; it "
            "shares the CPUs with the servers and the database and caps what can be seen."
        )
    else:
        text = (
            "Load generator: wrk (native, latency percentiles from its own histogram via a Lua "
            "`done` hook; POST bodies from a Lua script), on the same machine."
        )
    client = results.get("client_cpus")
    server = results.get("server_cpus")
    if client or server:
        text += (
            f" Pinned with taskset / sched_setaffinity: load generator on CPU {client or 'any'}, "
            f"uvicorn processes on CPU {server or 'any'}; the database server unpinned."
        )
    else:
        text += " Nothing pinned: generator, servers and database share every CPU."
    return text


def write(results: dict[str, Any], stem: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    lines = [
        "# Service benchmark",
        "",
        f"Machine: {results['machine']}; 1-minute load average "
        f"{results.get('load_average_start')} at start, {results.get('load_average_end')} at end "
        "(other work shares this machine: every figure is capped by it).",
        "",
    ]
    if results.get("api"):
        lines += _api_md(results)
    if results.get("noisy"):
        lines += ["", *_noisy_md(results["noisy"])]
    q = results.get("jobs", {}).get("queue_latency")
    if q:
        s = q["submit_to_start_s"]
        lines += [
            "",
            "## Submit to start (embedded: SQLite + filesystem broker, idle worker)",
            "",
            f"{q['jobs']} tiny jobs: median {s['median']} s, max {s['max']} s "
            f"(tiny job end to end: median {q['tiny_job_total_s']['median']} s).",
        ]
    rm = results.get("jobs", {}).get("real_model")
    if rm:
        lines += ["", "## A real job: SmolLM2-135M, 4 bits", ""]
        if "skipped" in rm or "failed" in rm:
            lines.append(f"Not measured: {rm.get('skipped') or rm.get('failed')}")
        else:
            lines += ["| stage | engine s |", "|---|---|"]
            lines += [f"| {k} | {v} |" for k, v in rm["engine_timings_s"].items()]
            lines += [
                "",
                f"Server total (created -> finished): {rm['server_total_s']} s; engine total "
                f"{rm['engine_total_s']} s; submit -> start {rm['submit_to_start_s']} s.",
                f"Service overhead: {rm['service_overhead_s']} s = "
                f"{100 * rm['service_overhead_share']:.1f}% of the engine time "
                f"(target < 10%: {'met' if rm['meets_target'] else 'NOT met'}). Device: {rm['device']}.",
            ]
    lines += [
        "",
        "Clients and servers share this machine's CPUs; figures are for this machine only.",
        "",
    ]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--duration", type=float, default=4.0, help="seconds per endpoint and client count"
    )
    ap.add_argument("--jobs", type=int, default=5)
    ap.add_argument("--postgres-url", default=os.environ.get("HIGGS_TEST_POSTGRES_URL"))
    ap.add_argument("--skip-model", action="store_true", help="skip the SmolLM2 job")
    ap.add_argument(
        "--api-only",
        action="store_true",
        help="only the API table (written to results/service_api.*)",
    )
    ap.add_argument(
        "--generator",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="load generator: wrk (native, when on PATH: auto) or the Python asyncio client",
    )
    ap.add_argument(
        "--client-cpus", help="pin wrk to these CPUs (taskset list, e.g. 1); default unpinned"
    )
    ap.add_argument(
        "--server-cpus",
        help="pin the uvicorn processes to these CPUs (e.g. 0); default unpinned",
    )
    ap.add_argument(
        "--clients",
        default=",".join(map(str, CLIENT_COUNTS)),
        help="client counts, comma-separated (default %(default)s)",
    )
    ap.add_argument(
        "--sqlite", action=argparse.BooleanOptionalAction, default=True, help="the SQLite rows"
    )
    ap.add_argument(
        "--stem", help="results file name (default: service, or service_api with --api-only)"
    )
    ap.add_argument(
        "--noisy",
        action="store_true",
        help="only the noisy-neighbour rows (written to results/service_noisy.*)",
    )
    ap.add_argument(
        "--redis-url",
        default=os.environ.get("HIGGS_TEST_REDIS_URL"),
        help="the broker of the PostgreSQL noisy-neighbour row (the compose shape)",
    )
    args = ap.parse_args()
    generator = args.generator
    if generator == "auto":
        generator = "wrk" if shutil.which("wrk") else "python"
    elif generator == "wrk" and not shutil.which("wrk"):
        ap.error("--generator wrk: wrk is not on PATH (Debian: apt-get install wrk)")
    if generator == "python" and args.client_cpus:
        ap.error("--client-cpus pins wrk; the Python client runs in this process")
    try:
        counts = tuple(int(c) for c in args.clients.split(","))
    except ValueError:
        ap.error(f"--clients {args.clients!r}: give client counts like 10,50")
    pins = {
        "client_counts": counts,
        "generator": generator,
        "client_cpus": args.client_cpus,
        "server_cpus": args.server_cpus,
    }

    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        # Other work on the machine caps every figure: the 1-minute load at start and end.
        "load_average_start": round(os.getloadavg()[0], 2),
        "duration_s": args.duration,
        **pins,
        "api": [],
    }
    if args.noisy:
        results["noisy"] = []
        if args.sqlite:
            results["noisy"].append(bench_noisy("sqlite", None, None, args.duration))
        if args.postgres_url:
            url, drop = scratch_postgres(args.postgres_url, "higgs_bench")
            try:
                results["noisy"].append(
                    bench_noisy("postgresql", url, args.redis_url, args.duration)
                )
            finally:
                drop()
        results["load_average_end"] = round(os.getloadavg()[0], 2)
        write(results, args.stem or "service_noisy")
        return 0
    if args.sqlite:
        results["api"].append(bench_api("sqlite", None, args.duration, **pins))
    if args.postgres_url:
        url, drop = scratch_postgres(args.postgres_url, "higgs_bench")
        try:
            results["api"].append(bench_api("postgresql", url, args.duration, **pins))
        finally:
            drop()
    else:
        results["api"].append(
            {"backend": "postgresql", "skipped": "no --postgres-url / HIGGS_TEST_POSTGRES_URL"}
        )
    results["verdict"] = verdict(results["api"])
    if not args.api_only:
        results["jobs"] = bench_jobs(args.jobs, not args.skip_model)
    results["load_average_end"] = round(os.getloadavg()[0], 2)
    write(results, args.stem or ("service_api" if args.api_only else "service"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
