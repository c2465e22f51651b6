"""End to end on an S3 store: an API and two Celery workers with separate data directories
(no shared disk: the API has no models folder and accepts the local model the workers
registered from theirs; artifacts go to the store), PostgreSQL and Redis, and a real S3
server (SeaweedFS). Jobs spread over the workers; every artifact file is downloaded through the API and checked
against its sha256; the bucket holds exactly the listed objects and no open multipart upload;
nothing is left on any process's disk."""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

import httpx
import pytest

from devtools.stack import HIGGS, Stack
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import files_under

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 180


def poll_all(c: httpx.Client, ids: list[str], stack: Stack) -> list[dict[str, Any]]:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    jobs: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        jobs = [c.get(f"/v1/jobs/{i}").json() for i in ids]
        if all(j["status"] in ("succeeded", "failed", "cancelled") for j in jobs):
            return jobs
        time.sleep(0.3)
    raise AssertionError(f"jobs not finished in {JOB_TIMEOUT_S}s: {jobs}\n{stack.logs()}")


def test_jobs_publish_to_s3_and_download_through_the_api(
    stack_factory: Any, s3_server: Any
) -> None:
    stack: Stack = stack_factory("redis-postgres")
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    stack.env.update({**s3_server.env, "HIGGS_ARTIFACTS_URL": f"s3://{s3_server.bucket}/{prefix}"})
    models_dir = stack.env.pop("HIGGS_MODELS_DIR")  # the workers' disk only
    stack.migrate()
    workers = [stack.tmp / f"worker{i}" for i in range(2)]
    for d in workers:
        stack.start_worker({"HIGGS_DATA_DIR": str(d), "HIGGS_MODELS_DIR": models_dir})
    stack.start_api()
    key = stack.create_key()
    body = {"model": {"id": MODEL}, "target": {"bits": 4}}
    with stack.client(key) as c:
        assert c.get("/readyz").json()["checks"]["store"] == "ok"
        # The workers register their models folder on their first sweep; until then a bare
        # name would be taken for a Hub id.
        deadline = time.monotonic() + 90
        while f"{MODEL}  " not in stack.run([*HIGGS, "models", "list"]).stdout:
            assert time.monotonic() < deadline, f"no worker registered {MODEL}:\n{stack.logs()}"
            time.sleep(0.5)
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 202, r.text
        ids = [r.json()["id"]]
        for _ in range(3):
            r = c.post("/v1/jobs", json=body)
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        assert (
            c.post("/v1/jobs", json={**body, "model": {"id": "not-on-any-worker"}}).status_code
            == 422
        )
        jobs = poll_all(c, ids, stack)
        assert [j["status"] for j in jobs] == ["succeeded"] * 4, jobs
        listed: set[str] = set()
        for job in jobs:
            for fmt in ("native", "dequantized"):
                listing = c.get(f"/v1/jobs/{job['id']}/artifacts/{fmt}").json()
                for f in listing["files"]:
                    r = c.get(f["url"])
                    assert r.status_code == 200, r.text
                    assert (
                        hashlib.sha256(r.content).hexdigest()
                        == f["sha256"]
                        == r.headers["x-checksum-sha256"]
                    )
                    part = c.get(f["url"], headers={"Range": "bytes=1-10"})
                    assert part.status_code == 206 and part.content == r.content[1:11]
                    listed.add(f"{fmt}/{f['path']}@{job['id']}")
    # The bucket: exactly the listed files, one attempt per job, no open multipart upload.
    s3 = s3_server.client()
    pages = s3.get_paginator("list_objects_v2").paginate(
        Bucket=s3_server.bucket, Prefix=prefix + "/"
    )
    objects = [o["Key"] for p in pages for o in p.get("Contents", [])]
    found = set()
    for key_ in objects:
        job_id, _attempt, rest = key_[len(prefix) + 1 :].split("/", 2)
        found.add(f"{rest}@{job_id}")
    assert found == listed and len(objects) == len(listed)
    uploads = s3.list_multipart_uploads(Bucket=s3_server.bucket, Prefix=prefix + "/")
    assert uploads.get("Uploads", []) == []
    # No process keeps artifact files on its own disk.
    for d in [stack.data_dir, *workers]:
        assert files_under(d / "artifacts") == [], d
