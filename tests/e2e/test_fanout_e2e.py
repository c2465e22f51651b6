"""One job fanned out over four workers, end to end with real processes: an API and four
Celery workers with separate data directories, Redis and PostgreSQL on loopback, SeaweedFS as
the artifact store, a tiny Llama saved in six shards. One pool process is SIGKILLed in the
middle of its part and one worker's main process (the whole worker) is killed; the job still
succeeds once, every file's sha256 equals a single-worker run's, the bucket holds exactly the
listed objects and no open multipart upload. A cancel in the middle of a fan-out leaves
nothing published and nothing in the bucket."""

from __future__ import annotations

import hashlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from devtools.stack import HIGGS, Proc, Stack
from tests.fixtures import build_tiny_checkpoint

pytestmark = pytest.mark.slow

MODEL = "tiny6"
TIMEOUT_S = 150


@pytest.fixture(scope="module")
def sharded_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fanout-models")
    build_tiny_checkpoint("llama", root / MODEL, max_shard_size="80KB")
    assert len(list((root / MODEL).glob("model-*.safetensors"))) == 6
    return root


def part_rows(db: Any, job_id: str) -> list[dict[str, Any]]:
    with db.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT idx, state, worker_id, progress_done, attempts FROM job_parts "
                "WHERE job_id = :j ORDER BY idx"
            ),
            {"j": job_id},
        ).mappings()
        return [dict(r) for r in rows]


def wait_for(cond: Any, what: str, stack: Stack, timeout: float = TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{stack.logs()}")


def owner_of(pool_pid: int, workers: list[Proc]) -> Proc:
    pgid = os.getpgid(pool_pid)
    return next(w for w in workers if w.popen.pid == pgid)


def bucket_keys(s3_server: Any, prefix: str) -> list[str]:
    s3 = s3_server.client()
    pages = s3.get_paginator("list_objects_v2").paginate(
        Bucket=s3_server.bucket, Prefix=prefix + "/"
    )
    return [o["Key"] for p in pages for o in p.get("Contents", [])]


def open_uploads(s3_server: Any, prefix: str) -> list[Any]:
    s3 = s3_server.client()
    ups = s3.list_multipart_uploads(Bucket=s3_server.bucket, Prefix=prefix + "/")
    return list(ups.get("Uploads", []))


def test_one_job_over_four_workers_survives_kills_and_cancel(
    stack_factory: Any, s3_server: Any, sharded_models: Path, tmp_path: Path
) -> None:
    stack: Stack = stack_factory("redis-postgres")
    prefix = f"fanout-{uuid.uuid4().hex[:8]}"
    stack.env.update(
        {
            **s3_server.env,
            "HIGGS_ARTIFACTS_URL": f"s3://{s3_server.bucket}/{prefix}",
            # Slow layers, so that a part is still running when a process is killed.
            "HIGGS_DEBUG_LAYER_DELAY_S": "0.7",
        }
    )
    stack.env.pop("HIGGS_MODELS_DIR")  # the workers' disk only
    stack.migrate()
    workers = [
        stack.start_worker(
            {
                "HIGGS_DATA_DIR": str(stack.tmp / f"worker{i}"),
                "HIGGS_MODELS_DIR": str(sharded_models),
            }
        )
        for i in range(4)
    ]
    stack.start_api()
    db = create_engine(stack.env["HIGGS_DATABASE_URL"])
    key = stack.create_key()
    body = {"model": {"id": MODEL}, "target": {"bits": 4}}
    try:
        with stack.client(key) as c:
            wait_for(
                lambda: f"{MODEL}  " in stack.run([*HIGGS, "models", "list"]).stdout,
                "a worker to register the model",
                stack,
                90,
            )
            # Without faults the chord's callback (counted on the Redis result backend)
            # assembles the job.
            r = c.post("/v1/jobs", json=body)
            assert r.status_code == 202, r.text
            clean = r.json()["id"]
            done = wait_for(
                lambda: (
                    (j := c.get(f"/v1/jobs/{clean}").json())["status"]
                    in ("succeeded", "failed", "cancelled")
                    and j
                ),
                "the job without faults",
                stack,
            )
            assert done["status"] == "succeeded", done
            rep = c.get(f"/v1/jobs/{clean}/report").json()
            assert rep["metrics"]["service"]["assembly_trigger"] == "chord"
            assert len(rep["metrics"]["parts"]) == 6

            r = c.post("/v1/jobs", json=body)
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            # The job fans out into six parts.
            wait_for(lambda: len(part_rows(db, job_id)) == 6, "six parts", stack)
            # A pool process SIGKILLed in the middle of its part.
            victim = wait_for(
                lambda: next(
                    (
                        p
                        for p in part_rows(db, job_id)
                        if p["state"] == "running" and p["progress_done"] >= 1
                    ),
                    None,
                ),
                "a part under way",
                stack,
            )
            pool_pid = int(victim["worker_id"].rsplit(":", 1)[1])
            spared = owner_of(pool_pid, workers)
            os.kill(pool_pid, signal.SIGKILL)
            # One whole worker (main process and pool) killed while it runs another part.
            other = wait_for(
                lambda: next(
                    (
                        p
                        for p in part_rows(db, job_id)
                        if p["state"] == "running"
                        and owner_of(int(p["worker_id"].rsplit(":", 1)[1]), workers) is not spared
                    ),
                    None,
                ),
                "a part on another worker",
                stack,
            )
            dead = owner_of(int(other["worker_id"].rsplit(":", 1)[1]), workers)
            dead.kill(signal.SIGKILL)
            job = wait_for(
                lambda: (
                    (j := c.get(f"/v1/jobs/{job_id}").json())["status"]
                    in ("succeeded", "failed", "cancelled")
                    and j
                ),
                "the fanned-out job",
                stack,
            )
            assert job["status"] == "succeeded", job
            assert job["attempts"] == 1, job  # the job succeeded once, parts were retried
            parts = part_rows(db, job_id)
            assert [p["state"] for p in parts] == ["done"] * 6
            assert sum(p["attempts"] for p in parts) >= 8  # the two killed parts ran again
            report = c.get(f"/v1/jobs/{job_id}/report").json()
            # The killed worker still holds its part's chord message (until the broker's
            # visibility timeout): the sweep's barrier sent the assembly.
            assert report["metrics"]["service"]["assembly_trigger"] == "sweep"
            listed_parts = report["metrics"]["parts"]
            assert [p["index"] for p in listed_parts] == list(range(6))
            assert all(p["worker_id"] and p["seconds"] > 0 for p in listed_parts)
            # Every file equals a single-worker run of the same source.
            from higgs_engine.job import QuantizeJob, run
            from higgs_engine.planning.config import HiggsConfig

            single = tmp_path / "single"
            run(
                QuantizeJob(sharded_models / MODEL, HiggsConfig.from_dict(report["config"])), single
            )
            listed: set[str] = set()
            for fmt in ("native", "dequantized"):
                listing = c.get(f"/v1/jobs/{job_id}/artifacts/{fmt}").json()
                want = {
                    p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                    for p in (single / fmt).iterdir()
                }
                assert {f["path"]: f["sha256"] for f in listing["files"]} == want
                for f in listing["files"]:
                    r = c.get(f["url"])
                    assert r.status_code == 200
                    assert hashlib.sha256(r.content).hexdigest() == f["sha256"]
                    listed.add(f"{fmt}/{f['path']}")
            keys = [k for k in bucket_keys(s3_server, prefix) if k.split("/")[1] == job_id]
            assert sorted(k.split("/", 3)[3] for k in keys) == sorted(listed), keys
            assert {k.split("/")[1] for k in bucket_keys(s3_server, prefix)} == {clean, job_id}
            assert open_uploads(s3_server, prefix) == []

            # Cancel in the middle of a fan-out: nothing published, nothing left in the bucket.
            r = c.post("/v1/jobs", json=body)
            assert r.status_code == 202, r.text
            job2 = r.json()["id"]
            wait_for(
                lambda: (
                    any(p["state"] == "done" for p in part_rows(db, job2))
                    and any(p["state"] == "running" for p in part_rows(db, job2))
                ),
                "one part done and another under way",
                stack,
            )
            assert c.post(f"/v1/jobs/{job2}/cancel").status_code in (200, 202)
            final = wait_for(
                lambda: (
                    (j := c.get(f"/v1/jobs/{job2}").json())["status"]
                    in ("succeeded", "failed", "cancelled")
                    and j
                ),
                "the cancel",
                stack,
            )
            assert final["status"] == "cancelled" and final["artifacts"] == [], final
            wait_for(
                lambda: all(p["state"] not in ("queued", "running") for p in part_rows(db, job2)),
                "every part stopped",
                stack,
            )
            wait_for(
                lambda: not [k for k in bucket_keys(s3_server, prefix) if f"/{job2}/" in k],
                "the cancelled job's objects removed",
                stack,
                30,
            )
            assert open_uploads(s3_server, prefix) == []
            assert {k.split("/")[1] for k in bucket_keys(s3_server, prefix)} == {clean, job_id}
    finally:
        db.dispose()
