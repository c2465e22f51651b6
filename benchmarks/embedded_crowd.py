#!/usr/bin/env python
"""The embedded default under a crowd: `higgs serve` (API + worker, SQLite, the filesystem
broker, as a user starts it) while `--pollers` clients poll GET job flat out, `--downloads`
slow 8 MiB downloads and `--streams` event streams stay open (read a few hundred bytes every
50 ms). The pollers' throughput and p50 / p99 / max latency, per configuration, measured back
to back in one run on the same machine:

- `before`: the API as it was before fair queueing (HIGGS_API_CONCURRENCY=0: no admission
  queue; HIGGS_THREADPOOL_SIZE=40, anyio's default): every request in flight at once;
- `after`: the defaults (an admission queue of HIGGS_API_CONCURRENCY requests at a time,
  served in arrival order, and a threadpool of that size).

Goal: the pollers' p99 under 2 s in `after`. The machine's other work shares the CPUs with the
service and the load generator, so the two configurations run back to back (alternating when
--rounds > 1) and the 1-minute load average is recorded with each.

Load generator for the pollers: wrk when it is on PATH (native, latency percentiles from its
own histogram), else the Python asyncio client of benchmarks/service_bench.py, which on a
small machine adds its own delays; the JSON records which one ran. Writes
benchmarks/results/<stem>.json + .md (default stem embedded_crowd).

Usage: python -m benchmarks.embedded_crowd [--pollers 200] [--downloads 30] [--streams 30]
                                           [--duration 10] [--rounds 1] [--stem S]
                                           [--generator auto|wrk|python]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from benchmarks.service_bench import (
    NOISY_FILE_BYTES,
    SUBMIT_BODY,
    SlowReader,
    load,
    make_stack,
    start_nibbling,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

# The environment of each configuration (on top of the defaults); see the module docstring.
CONFIGS: dict[str, dict[str, str]] = {
    "before": {"HIGGS_API_CONCURRENCY": "0", "HIGGS_THREADPOOL_SIZE": "40"},
    "after": {},
}
# Streams per key: HIGGS_MAX_EVENT_STREAMS_PER_KEY's default is 10, so the streams are spread
# over keys of their own (all of them open, none answered 429).
STREAMS_PER_KEY = 10


def seed(stack: Any, streams: int) -> dict[str, Any]:
    """Keys, a running job (polled, and followed by the streams) and a succeeded job with an
    8 MiB artifact file (downloaded), written to the database before the service starts: no
    job is ever queued, so the worker stays idle and the sweep leaves them alone."""
    from app.artifacts.manifest import artifact_row
    from app.db.session import create_db_engine, session_factory
    from app.jobs import state
    from app.jobs.schemas import JobCreate
    from app.jobs.service import create_job, validate_request
    from app.keys.service import AuthKey, find_key
    from app.settings import Settings

    stack.migrate()
    pollers = stack.create_key("pollers")
    readers = [
        stack.create_key(f"readers{i}") for i in range(max(1, -(-streams // STREAMS_PER_KEY)))
    ]
    settings = Settings(data_dir=stack.data_dir, models_dir=Path(stack.env["HIGGS_MODELS_DIR"]))
    spec = validate_request(JobCreate.model_validate(SUBMIT_BODY), settings)
    engine = create_db_engine(settings.database_url)
    try:
        with session_factory(engine)() as s:
            key = AuthKey.of(find_key(s, pollers))
            running, _ = create_job(s, key, spec, None)
            done, _ = create_job(s, AuthKey.of(find_key(s, readers[0])), spec, None)
            own = [AuthKey.of(find_key(s, k)) for k in readers]
            followed = [create_job(s, k, spec, None)[0].id for k in own]
            store = stack.tmp / "store" / done.id / "native"
            store.mkdir(parents=True)
            (store / "model.safetensors").write_bytes(b"\x01" * NOISY_FILE_BYTES)
            for job_id in (running.id, done.id, *followed):
                state.claim(s, job_id, "bench")
            state.succeed(s, done.id, {"layers": []}, [], [artifact_row("native", store)])
    finally:
        engine.dispose()
    return {
        "pollers_key": pollers,
        "readers": readers,
        "poll_path": f"/v1/jobs/{running.id}",
        "file_path": f"/v1/jobs/{done.id}/artifacts/native/files/model.safetensors",
        "stream_paths": [f"/v1/jobs/{j}/events" for j in followed],
    }


def run_config(name: str, env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """One configuration: a fresh data folder, `higgs serve`, the downloads and streams opened
    and nibbled in a thread, the pollers for `args.duration` seconds."""
    root = Path(tempfile.mkdtemp(prefix=f"higgs-crowd-{name}-"))
    (root / "models" / "tiny").mkdir(parents=True)  # validated by name only: no job runs
    stack = make_stack(
        root,
        {
            "HIGGS_MODELS_DIR": str(root / "models"),
            # The pollers are one key flat out: no request rate limit (it would answer most of
            # them 429); the running jobs' heartbeats never go stale during the run.
            "HIGGS_RATE_LIMIT_PER_S": "0",
            "HIGGS_HEARTBEAT_TIMEOUT_S": "3600",
            **env,
        },
    )
    readers: list[SlowReader] = []
    stop = threading.Event()
    load_start = round(os.getloadavg()[0], 2)
    try:
        ids = seed(stack, args.streams)
        stack.start_serve(timeout=120)
        for i in range(args.streams):
            key = ids["readers"][i // STREAMS_PER_KEY]
            path = ids["stream_paths"][i // STREAMS_PER_KEY]
            readers.append(SlowReader(stack.url, path, key))
        owner = ids["readers"][0]
        readers += [SlowReader(stack.url, ids["file_path"], owner) for _ in range(args.downloads)]
        statuses, nibbler = start_nibbling(readers, stop)
        polls = load(
            args.generator,
            stack.url,
            ids["pollers_key"],
            "GET",
            ids["poll_path"],
            args.pollers,
            args.duration,
            None,
        )
        stop.set()
        nibbler.join(5)
        alive = sum(1 for r in readers if r.received > 0)
    finally:
        stop.set()
        for r in readers:
            r.close()
        stack.close()
        shutil.rmtree(root, ignore_errors=True)
    row = {
        "config": name,
        "env": env,
        "pollers": polls,
        "held_open": {"streams": args.streams, "downloads": args.downloads, "statuses": statuses},
        "readers_served": alive,
        "load_average_start": load_start,
        "load_average_end": round(os.getloadavg()[0], 2),
        "p99_under_2s": bool(polls["requests"]) and polls["p99_ms"] < 2000,
    }
    print(
        f"{name}: {polls['throughput_rps']} polls/s, p50 {polls['p50_ms']} ms, p99 "
        f"{polls['p99_ms']} ms, max {polls['max_ms']} ms, errors {polls['errors']}; held open "
        f"{statuses}",
        flush=True,
    )
    return row


def write(results: dict[str, Any], stem: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    gen = (
        "wrk (native; latency percentiles from its own histogram)"
        if results["generator"] == "wrk"
        else "one Python asyncio client process (httpx) on the same machine, which adds its own "
        "delays at this many clients"
    )
    lines = [
        "# The embedded default under a crowd",
        "",
        f"Machine: {results['machine']}. `higgs serve` (one API process, SQLite, the "
        f"filesystem broker, its worker idle): {results['pollers']} clients poll GET job flat "
        f"out for {results['duration_s']:g} s (after a 1 s warm-up) while {results['streams']} "
        f"event streams and {results['downloads']} slow 8 MiB downloads stay open (a few hundred "
        f"bytes read every 50 ms). Pollers: {gen}. Request rate limit off (one key polls). The "
        "configurations ran back to back in one run; other work shares this machine (the "
        "1-minute load average is listed), so compare rows of one run, not absolute figures.",
        "",
        "| config | settings | polls/s | p50 ms | p99 ms | max ms | errors | held open (statuses) "
        "| load avg | p99 < 2 s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        p = r["pollers"]
        env = ", ".join(f"{k}={v}" for k, v in r["env"].items()) or "defaults"
        held = ", ".join(f"{k}: {v}" for k, v in sorted(r["held_open"]["statuses"].items()))
        lines.append(
            f"| {r['config']} | {env} | {p['throughput_rps']} | {p['p50_ms']} | {p['p99_ms']} | "
            f"{p['max_ms']} | {sum(p['errors'].values()) or 0} | {held} | "
            f"{r['load_average_start']} -> {r['load_average_end']} | "
            f"{'yes' if r['p99_under_2s'] else 'NO'} |"
        )
    lines.append("")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pollers", type=int, default=200)
    ap.add_argument("--downloads", type=int, default=30)
    ap.add_argument("--streams", type=int, default=30)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of polling per row")
    ap.add_argument("--rounds", type=int, default=1, help="before/after pairs, alternating")
    ap.add_argument("--configs", default="before,after", help="which configurations, in order")
    ap.add_argument("--generator", choices=("auto", "wrk", "python"), default="auto")
    ap.add_argument("--stem", default="embedded_crowd")
    args = ap.parse_args()
    if args.generator == "auto":
        args.generator = "wrk" if shutil.which("wrk") else "python"
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    rows = [run_config(name, CONFIGS[name], args) for _ in range(args.rounds) for name in names]
    write(
        {
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}",
            "generator": args.generator,
            "pollers": args.pollers,
            "downloads": args.downloads,
            "streams": args.streams,
            "duration_s": args.duration,
            "rows": rows,
        },
        args.stem,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
