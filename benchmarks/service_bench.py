#!/usr/bin/env python
"""Service benchmark: API polling load, queue latency and where a real job's time goes.

1. Status polling: `--clients` concurrent clients (50) each poll GET /v1/jobs/{id} in a loop
   for `--duration` seconds against uvicorn with 2 worker processes, on SQLite (the embedded
   default) and on PostgreSQL (when --postgres-url or HIGGS_TEST_POSTGRES_URL is given).
   Throughput (requests/s) and p50 / p99 latency.
2. Queue latency: time from submit (job created_at) to the worker starting it (started_at),
   over several tiny jobs on the embedded default (SQLite + filesystem broker).
3. A real job: SmolLM2-135M (data/smollm2-135m, prepared by scripts/prepare_data.py) at 4 bits,
   time per stage, and the service overhead = (finished_at - created_at) - the engine's own
   total time (report.json timings), as a share of the engine time (target < 10%).

Everything runs as real processes (uvicorn, Celery worker) on this machine; the clients share
its CPUs with the server, which caps the figures. Writes benchmarks/results/service.json + .md.

Usage: python benchmarks/service_bench.py [--duration 10] [--clients 50] [--jobs 5]
                                          [--postgres-url URL] [--skip-model]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the development helpers (devtools/)

from devtools.scratch import scratch_postgres  # noqa: E402
from devtools.stack import Stack  # noqa: E402

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
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(dest), safe_serialization=True)


# ---------------------------------------------------------------- 1. polling load


async def _client_loop(url: str, key: str, path: str, stop_at: float, lat: list[float], errors: list[int]) -> None:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=30) as c:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                r = await c.get(path)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            (lat.append(time.perf_counter() - t0) if ok else errors.append(1))


async def _load(url: str, key: str, path: str, clients: int, duration: float) -> dict[str, Any]:
    lat: list[float] = []
    errors: list[int] = []
    # Warm-up: every uvicorn worker has its pools open before timing starts.
    await asyncio.gather(*[_client_loop(url, key, path, time.perf_counter() + 1.0, [], []) for _ in range(clients)])
    t0 = time.perf_counter()
    await asyncio.gather(*[_client_loop(url, key, path, t0 + duration, lat, errors) for _ in range(clients)])
    wall = time.perf_counter() - t0
    lat.sort()
    q = statistics.quantiles(lat, n=100) if len(lat) >= 100 else [float("nan")] * 99
    return {
        "clients": clients,
        "duration_s": round(wall, 3),
        "requests": len(lat),
        "errors": len(errors),
        "throughput_rps": round(len(lat) / wall, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
        "max_ms": round(lat[-1] * 1000, 2) if lat else None,
    }


def bench_polling(backend: str, db_url: str | None, clients: int, duration: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"higgs-bench-{backend}-"))
    (root / "models").mkdir()
    tiny_model(root / "models" / "tiny")
    env = {"HIGGS_MODELS_DIR": str(root / "models")}
    if db_url:
        env["HIGGS_DATABASE_URL"] = db_url
    stack = make_stack(root, env)
    try:
        stack.migrate()
        stack.start_api(workers=2, timeout=90)
        key = stack.create_key("bench")
        r = httpx.post(stack.url + "/v1/jobs", json={"model": {"id": "tiny"}, "target": {"bits": 4}},
                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
        r.raise_for_status()
        job_id = r.json()["id"]
        result = asyncio.run(_load(stack.url, key, f"/v1/jobs/{job_id}", clients, duration))
        result.update({"backend": backend, "uvicorn_workers": 2, "endpoint": "GET /v1/jobs/{id}"})
        return result
    finally:
        stack.close()


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


def bench_jobs(n_jobs: int, with_model: bool) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="higgs-bench-jobs-"))
    models = root / "models"
    models.mkdir()
    tiny_model(models / "tiny")
    model_note = ""
    if with_model and (SMOLLM / "config.json").is_file():
        (models / "smollm2-135m").symlink_to(SMOLLM)
    elif with_model:
        model_note = f"{SMOLLM} is not prepared (python scripts/prepare_data.py); real-model part skipped"
    stack = make_stack(root, {"HIGGS_MODELS_DIR": str(models)})
    out: dict[str, Any] = {}
    try:
        stack.migrate()
        stack.start_api(workers=1, timeout=90)
        stack.start_worker(log_level="WARNING")
        key = stack.create_key("bench")
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
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
                "submit_to_start_s": {"median": round(statistics.median(waits), 4), "max": round(max(waits), 4),
                                      "all": [round(w, 4) for w in waits]},
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


def write(results: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "service.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    lines = ["# Service benchmark", "", f"Machine: {results['machine']}; 1-minute load average "
             f"{results.get('load_average_start')} at start, {results.get('load_average_end')} at end.", ""]
    lines += ["## Status polling (GET /v1/jobs/{id}, uvicorn --workers 2)", "",
              "| backend | clients | requests | errors | req/s | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|"]
    for r in results["polling"]:
        if "skipped" in r:
            lines.append(f"| {r['backend']} | skipped: {r['skipped']} | | | | | |")
        else:
            lines.append(f"| {r['backend']} | {r['clients']} | {r['requests']} | {r['errors']} | "
                         f"{r['throughput_rps']} | {r['p50_ms']} | {r['p99_ms']} |")
    q = results.get("jobs", {}).get("queue_latency")
    if q:
        s = q["submit_to_start_s"]
        lines += ["", "## Submit to start (embedded: SQLite + filesystem broker, idle worker)", "",
                  f"{q['jobs']} tiny jobs: median {s['median']} s, max {s['max']} s "
                  f"(tiny job end to end: median {q['tiny_job_total_s']['median']} s)."]
    rm = results.get("jobs", {}).get("real_model")
    if rm:
        lines += ["", "## A real job: SmolLM2-135M, 4 bits", ""]
        if "skipped" in rm or "failed" in rm:
            lines.append(f"Not measured: {rm.get('skipped') or rm.get('failed')}")
        else:
            lines += ["| stage | engine s |", "|---|---|"]
            lines += [f"| {k} | {v} |" for k, v in rm["engine_timings_s"].items()]
            lines += ["", f"Server total (created -> finished): {rm['server_total_s']} s; engine total "
                      f"{rm['engine_total_s']} s; submit -> start {rm['submit_to_start_s']} s.",
                      f"Service overhead: {rm['service_overhead_s']} s = "
                      f"{100 * rm['service_overhead_share']:.1f}% of the engine time "
                      f"(target < 10%: {'met' if rm['meets_target'] else 'NOT met'}). Device: {rm['device']}."]
    lines += ["", "Clients and servers share this machine's CPUs; figures are for this machine only.", ""]
    (RESULTS / "service.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=5)
    ap.add_argument("--postgres-url", default=os.environ.get("HIGGS_TEST_POSTGRES_URL"))
    ap.add_argument("--skip-model", action="store_true", help="skip the SmolLM2 job")
    args = ap.parse_args()

    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        # Other work on the machine caps every figure: the 1-minute load at start and end.
        "load_average_start": round(os.getloadavg()[0], 2),
        "polling": [],
    }
    results["polling"].append(bench_polling("sqlite", None, args.clients, args.duration))
    if args.postgres_url:
        url, drop = scratch_postgres(args.postgres_url, "higgs_bench")
        try:
            results["polling"].append(bench_polling("postgresql", url, args.clients, args.duration))
        finally:
            drop()
    else:
        results["polling"].append({"backend": "postgresql", "skipped": "no --postgres-url / HIGGS_TEST_POSTGRES_URL"})
    results["jobs"] = bench_jobs(args.jobs, not args.skip_model)
    results["load_average_end"] = round(os.getloadavg()[0], 2)
    write(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
