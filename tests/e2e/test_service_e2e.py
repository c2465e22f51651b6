"""The service end to end, with real processes: uvicorn serving the API, Celery workers,
`higgs serve`, the `higgs` client; SQLite + the filesystem broker, or PostgreSQL + Redis
(HIGGS_TEST_POSTGRES_URL / HIGGS_TEST_REDIS_URL, set by .ci/run)."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.stack import HIGGS, Stack
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import files_under, make_hub_cache

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 120
SLOW_WORKER = {"HIGGS_DEBUG_LAYER_DELAY_S": "0.6"}  # test-only: ~8 s for the tiny model's 14 layers


def poll(
    c: httpx.Client,
    job_id: str,
    until: Any,
    timeout: float = JOB_TIMEOUT_S,
    stack: Stack | None = None,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        r = c.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        job = r.json()
        if until(job):
            return job
        time.sleep(0.2)
    logs = stack.logs() if stack else ""
    raise AssertionError(f"job {job_id} did not get there in {timeout}s; last: {job}\n{logs}")


def terminal(job: dict[str, Any]) -> bool:
    return job["status"] in ("succeeded", "failed", "cancelled")


def submit(c: httpx.Client, model: str = MODEL, **extra: Any) -> str:
    r = c.post("/v1/jobs", json={"model": {"id": model, **extra}, "target": {"bits": 4}})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert r.headers["Location"].endswith(f"/v1/jobs/{job_id}")
    return str(job_id)


def start_separate(stack: Stack, worker_env: dict[str, str] | None = None) -> None:
    """Migrate with the alembic command, then start uvicorn and one Celery worker."""
    stack.run([sys.executable, "-m", "alembic", "upgrade", "head"])
    stack.start_worker(worker_env)  # starts (imports torch) while the API comes up
    worker = stack.procs[-1]
    stack.start_api()
    stack.procs.remove(worker)
    stack.procs.append(worker)  # procs[-1] stays "the worker" for the tests


def check_download_and_load(
    stack: Stack, c: httpx.Client, key: str, job_id: str, dest: Path
) -> None:
    """List the native artifact, download a file whole and by Range (sha256 checked), download
    the whole artifact with `higgs download`, load it with the engine and run a forward pass."""
    listing = c.get(f"/v1/jobs/{job_id}/artifacts/native")
    assert listing.status_code == 200, listing.text
    files = listing.json()["files"]
    assert {"config.json"} <= {f["path"] for f in files}
    big = max(files, key=lambda f: f["bytes"])
    url = f"/v1/jobs/{job_id}/artifacts/native/files/{big['path']}"

    whole = c.get(url)
    assert whole.status_code == 200
    assert int(whole.headers["Content-Length"]) == big["bytes"] == len(whole.content)
    assert hashlib.sha256(whole.content).hexdigest() == big["sha256"]
    assert whole.headers["X-Checksum-Sha256"] == big["sha256"]

    part = c.get(url, headers={"Range": "bytes=100-4195"})
    assert part.status_code == 206
    assert part.content == whole.content[100:4196]
    assert part.headers["Content-Range"] == f"bytes 100-4195/{big['bytes']}"

    # The client: a partial file is resumed with Range, everything is verified.
    out = dest / "native"
    out.mkdir(parents=True)
    (out / (big["path"] + ".part")).write_bytes(whole.content[: big["bytes"] // 2])
    env_args = ["--url", stack.url, "--key", key]
    res = stack.run(
        [*HIGGS, "download", job_id, "--format", "native", "--out", str(out), "-q", *env_args]
    )
    assert re.search(rf"^resumed\s+{re.escape(big['path'])}$", res.stdout, re.M), res.stdout
    for f in files:
        assert hashlib.sha256((out / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    again = stack.run([*HIGGS, "download", job_id, "--out", str(out), "-q", *env_args])
    assert re.search(rf"^skipped\s+{re.escape(big['path'])}$", again.stdout, re.M), again.stdout

    import torch

    from higgs_engine.artifacts import load_model

    model, _ = load_model(out)
    config: Any = model.config  # the transformers config of the loaded model
    vocab = int(config.vocab_size)
    ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 12, vocab)
    assert torch.isfinite(logits).all()


def exactly_one_artifact_set(stack: Stack, job: dict[str, Any]) -> None:
    job_dir = stack.artifacts_dir / job["id"]
    attempts = list(job_dir.iterdir())
    assert len(attempts) == 1, attempts
    assert sorted(a["format"] for a in job["artifacts"]) == ["dequantized", "native"]
    assert files_under(stack.artifacts_dir / ".staging") == []


# ---------------------------------------------------------------- 1 + 2: the whole flow


def test_flow_on_redis_and_postgres(stack_factory: Any, tmp_path: Path) -> None:
    stack = stack_factory("redis-postgres")
    start_separate(stack)
    key = stack.create_key()
    with stack.client(key) as c:
        job_id = submit(c)
        job = poll(c, job_id, terminal, stack=stack)
        assert job["status"] == "succeeded", job
        assert job["summary"]["bits_per_weight"] > 4
        assert job["attempts"] == 1
        exactly_one_artifact_set(stack, job)
        check_download_and_load(stack, c, key, job_id, tmp_path / "dl")
        layers = c.get(f"/v1/jobs/{job_id}/layers")
        assert layers.status_code == 200

        # scope=all through the client verb: the embedding is quantized, the whole model is
        # smaller, and the downloaded native artifact loads and runs.
        server = ["--url", stack.url, "--key", key]
        res = stack.run([*HIGGS, "submit", MODEL, "--bits", "4", "--scope", "all", *server])
        all_id = res.stdout.strip().splitlines()[-1]
        done = poll(c, all_id, terminal, stack=stack)
        assert done["status"] == "succeeded", done
        assert done["config"]["engine"]["scope"] == "all"
        total = done["summary"]["bits_per_param_total"]
        assert total < 0.7 * job["summary"]["bits_per_param_total"]
        rows = {r["name"]: r for r in c.get(f"/v1/jobs/{all_id}/layers").json()["data"]}
        assert rows["model.embed_tokens"]["p"] == 2
        check_download_and_load(stack, c, key, all_id, tmp_path / "dl-all")


def test_flow_on_the_embedded_default(stack_factory: Any, tmp_path: Path) -> None:
    stack = stack_factory("local")
    data = stack.data_dir
    # The tiny job quantizes in well under the client's 0.5 s poll interval: slow its layers
    # (test-only knob) so that the progress bar is sure to see the quantizing stage.
    serve = stack.start_serve({"HIGGS_DEBUG_LAYER_DELAY_S": "0.15"})
    assert (data / "higgs.db").is_file() and (data / "broker").is_dir()
    key = stack.create_key(data_dir=data)

    # The client verb with --wait: live progress, then the download.
    out = tmp_path / "submitted"
    res = stack.run(
        [
            *HIGGS,
            "submit",
            MODEL,
            "--bits",
            "4",
            "--wait",
            "--out",
            str(out),
            "--url",
            stack.url,
            "--key",
            key,
        ],
        timeout=JOB_TIMEOUT_S,
    )
    job_id = res.stdout.strip().splitlines()[-1]
    assert "succeeded" in res.stdout and (out / "config.json").is_file(), res.stdout + res.stderr
    assert "quantizing" in res.stderr  # the progress bar showed the stage
    status = stack.run([*HIGGS, "status", job_id, "--url", stack.url, "--key", key])
    assert "succeeded" in status.stdout

    with stack.client(key) as c:
        job = c.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "succeeded"
        exactly_one_artifact_set(stack, job)
        check_download_and_load(stack, c, key, job_id, tmp_path / "dl")

    pids = [
        int(x)
        for x in re.findall(
            r"=(\d+)", next(ln for ln in serve.tail(400).splitlines() if "pids" in ln)
        )
    ]
    assert len(pids) == 2
    serve.popen.send_signal(signal.SIGTERM)
    assert serve.popen.wait(40) == 0, serve.tail()
    for pid in pids:  # both children are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ---------------------------------------------------------------- 3: a worker dies mid-job


@pytest.mark.parametrize("kind", ["local", "redis-postgres"])
def test_job_survives_a_worker_killed_mid_job(stack_factory: Any, kind: str) -> None:
    stack = stack_factory(kind)
    start_separate(stack, SLOW_WORKER)
    first = stack.procs[-1]
    key = stack.create_key()
    with stack.client(key) as c:
        job_id = submit(c)
        poll(
            c,
            job_id,
            lambda j: j["stage"] == "quantizing" and j["progress"]["done"] >= 2,
            stack=stack,
        )
        first.kill(signal.SIGKILL)  # the whole worker: main process and pool child
        first.popen.wait(10)
        assert c.get(f"/v1/jobs/{job_id}").json()["status"] == "running"
        stack.start_worker()  # a fresh worker: its sweep re-queues the job once the heartbeat is stale
        job = poll(c, job_id, terminal, stack=stack)
        assert job["status"] == "succeeded", job
        assert job["attempts"] == 2
        exactly_one_artifact_set(stack, job)
        listing = c.get(f"/v1/jobs/{job_id}/artifacts/native").json()
        root = stack.artifacts_dir / job_id
        assert sum(1 for _ in files_under(root) if _.parent.name == "native") == len(
            listing["files"]
        )


# ---------------------------------------------------------------- 4: cancel


def test_cancelled_running_job_leaves_nothing_downloadable(stack_factory: Any) -> None:
    stack = stack_factory("local")
    start_separate(stack, SLOW_WORKER)
    key = stack.create_key()
    with stack.client(key) as c:
        job_id = submit(c)
        poll(
            c,
            job_id,
            lambda j: j["stage"] == "quantizing" and j["progress"]["done"] >= 1,
            stack=stack,
        )
        r = c.post(f"/v1/jobs/{job_id}/cancel")
        assert r.status_code in (200, 202), r.text
        job = poll(c, job_id, terminal, stack=stack)
        assert job["status"] == "cancelled" and job["artifacts"] == []
        for fmt in ("native", "dequantized"):
            r = c.get(f"/v1/jobs/{job_id}/artifacts/{fmt}")
            assert r.status_code == 404 and r.headers["content-type"].startswith(
                "application/problem+json"
            )
        assert c.get(f"/v1/jobs/{job_id}/artifacts/native/files/config.json").status_code == 404
        assert c.post(f"/v1/jobs/{job_id}/cancel").status_code == 409
    # Give the worker a moment to finish its cleanup, then: not a single file for this job.
    deadline = time.monotonic() + 10
    while files_under(stack.artifacts_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert files_under(stack.artifacts_dir) == []


# ---------------------------------------------------------------- 5: Hub model, offline


def test_hub_model_from_the_cache_offline_records_the_sha(
    stack_factory: Any, e2e_models_dir: Path
) -> None:
    stack = stack_factory("local")
    assert stack.env["HF_HUB_OFFLINE"] == "1"
    sha = make_hub_cache(
        Path(stack.env["HF_HOME"]) / "hub", "acme/tiny-llama", e2e_models_dir / MODEL
    )
    start_separate(stack)
    key = stack.create_key()
    with stack.client(key) as c:
        job_id = submit(c, "acme/tiny-llama", revision="main")
        job = poll(c, job_id, terminal, stack=stack)
        assert job["status"] == "succeeded", job
        assert job["model"]["revision"] == "main" and job["model"]["resolved_revision"] == sha
        report = c.get(f"/v1/jobs/{job_id}/report").json()
        assert report["source"]["revision"] == sha and report["source"]["id"] == "acme/tiny-llama"

        missing = submit(c, "acme/not-cached")
        job = poll(c, missing, terminal, stack=stack)
        assert job["status"] == "failed" and job["error"]["code"] == "model_not_found", job
