"""The runner publishing to a real S3 store (SeaweedFS on loopback): the objects are exactly
the listed files with the worker's sha256, nothing is left of earlier attempts or of an
attempt cancelled before publication, and an unreachable store puts the job back in the queue
as storage_unavailable until the sweep sees the store answer again."""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.store import S3Store
from app.db.models import Job
from app.jobs import state
from app.settings import Settings
from devtools.stack import free_port
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import files_under
from tests.worker.helpers import create_job
from worker.config import RunnerConfig
from worker.runner import run_job
from worker.sweep import sweep

BODY = {"model": {"id": MODEL}, "target": {"bits": 4}}


def _job(sessions: sessionmaker[Session], job_id: str) -> Job:
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        _ = job.artifacts, [a.files for a in job.artifacts]
        s.expunge_all()
        return job


def keys(client: Any, bucket: str, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for p in pages for o in p.get("Contents", []))


def open_uploads(client: Any, bucket: str, prefix: str) -> list[str]:
    got = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    return [u["Key"] for u in got]


@pytest.fixture
def store(s3_server: Any) -> S3Store:
    return S3Store(
        s3_server.bucket,
        f"w-{uuid.uuid4().hex[:8]}",
        endpoint_url=s3_server.endpoint,
        part_size=5 * 2**20,
        client=s3_server.client(),
    )


def test_job_publishes_exactly_its_files_to_s3(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig, store: S3Store
) -> None:
    job_id = create_job(sessions, settings, BODY)
    c, b, p = store.client, store.bucket, store.prefix
    # What a killed earlier attempt left: an object and an open multipart upload.
    c.put_object(Bucket=b, Key=f"{p}/{job_id}/0.dead/native/model.safetensors", Body=b"half")
    c.create_multipart_upload(Bucket=b, Key=f"{p}/{job_id}/0.dead/dequantized/x.bin")
    cfg = dataclasses.replace(runner_cfg, store=store)
    out = run_job(sessions, job_id, cfg, worker_id="w1")
    assert out.status == "succeeded", out.detail
    job = _job(sessions, job_id)
    assert sorted(a.format for a in job.artifacts) == ["dequantized", "native"]
    listed = []
    for art in job.artifacts:
        assert art.uri.startswith(f"s3://{b}/{p}/{job_id}/") and art.uri.endswith(f"/{art.format}")
        key_root = art.uri[len(f"s3://{b}/") :]
        for f in art.files:
            key = f"{key_root}/{f.path}"
            listed.append(key)
            body = c.get_object(Bucket=b, Key=key)
            data = body["Body"].read()
            assert len(data) == f.bytes and hashlib.sha256(data).hexdigest() == f.sha256
            assert body["Metadata"]["sha256"] == f.sha256
    assert keys(c, b, f"{p}/") == sorted(listed)  # the dead attempt's object is gone
    assert open_uploads(c, b, f"{p}/") == []
    # Nothing on the worker's disk: staging removed, no local artifact folder.
    assert files_under(settings.artifacts_path) == []


def test_cancel_after_upload_before_publication_leaves_nothing(
    settings: Settings,
    sessions: sessionmaker[Session],
    runner_cfg: RunnerConfig,
    store: S3Store,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job_id = create_job(sessions, settings, BODY)
    real = S3Store.upload

    def upload_then_cancel(self: S3Store, *args: Any, **kwargs: Any) -> bool:
        ok = real(self, *args, **kwargs)
        assert keys(store.client, store.bucket, f"{store.prefix}/") != []  # uploaded...
        with sessions() as s:
            state.request_cancel(s, job_id)  # ...and cancelled before it is recorded
        return ok

    monkeypatch.setattr(S3Store, "upload", upload_then_cancel)
    out = run_job(sessions, job_id, dataclasses.replace(runner_cfg, store=store), worker_id="w1")
    assert out.status == "cancelled"
    job = _job(sessions, job_id)
    assert job.status == "cancelled" and job.artifacts == []
    assert keys(store.client, store.bucket, f"{store.prefix}/") == []
    assert open_uploads(store.client, store.bucket, f"{store.prefix}/") == []


def test_unreachable_store_puts_the_job_back_until_it_answers(
    settings: Settings,
    sessions: sessionmaker[Session],
    runner_cfg: RunnerConfig,
    store: S3Store,
    s3_server: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job_id = create_job(sessions, settings, BODY)
    dead_endpoint = f"http://127.0.0.1:{free_port()}"
    dead = S3Store("higgs", "p", endpoint_url=dead_endpoint, timeout_s=1)
    out = run_job(sessions, job_id, dataclasses.replace(runner_cfg, store=dead), worker_id="w1")
    assert out.status == "storage_unavailable"
    job = _job(sessions, job_id)
    assert (job.status, job.error_code, job.attempts, job.enqueued_at) == (
        "queued",
        "storage_unavailable",
        0,
        None,
    )
    assert "127.0.0.1" not in (job.error_message or "")
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    sent: list[str] = []

    def send(job: str) -> bool:
        sent.append(job)
        return True

    down = settings.model_copy(
        update={
            "artifacts_url": "s3://higgs/p",
            "s3_endpoint_url": dead_endpoint,
            "s3_timeout_s": 1,
        }
    )
    r = sweep(sessions, down, send)
    assert r.storage == [] and r.sent == [] and sent == []  # the store is still away
    up = settings.model_copy(
        update={
            "artifacts_url": f"s3://{store.bucket}/{store.prefix}",
            "s3_endpoint_url": s3_server.endpoint,
        }
    )
    assert sweep(sessions, up, send).storage == [job_id] and sent == [job_id]
    assert sweep(sessions, up, send).storage == []  # sent once
    out = run_job(sessions, job_id, dataclasses.replace(runner_cfg, store=store), worker_id="w2")
    assert out.status == "succeeded", out.detail
    job = _job(sessions, job_id)
    assert (job.status, job.error_code, job.attempts) == ("succeeded", None, 1)
