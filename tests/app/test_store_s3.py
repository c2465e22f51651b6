"""The artifact store against a real S3 server (SeaweedFS on loopback, boto3): multipart
uploads with sha256 metadata, ranged reads, cleanup of attempts and open multipart uploads,
an unreachable or misconfigured store; and the API serving S3 artifacts (Range, ETag, digest
headers, archives, presigned redirects, 500 for a lost object, 503 for a store that is away)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.manifest import artifact_row
from app.artifacts.store import (
    S3Store,
    StoreObjectMissingError,
    StoreUnavailableError,
    UploadFile,
    join_uri,
    store_from_settings,
)
from app.jobs import state
from app.keys.service import create_key
from app.main import create_app
from app.settings import Settings
from devtools.stack import free_port
from tests.fixtures import assert_problem

BODY = {"model": {"id": "tiny"}, "target": {"bits": 4}}
MIB = 2**20


@pytest.fixture
def store(s3_server: Any) -> S3Store:
    # A fresh prefix per test: the tests share one bucket.
    return S3Store(
        s3_server.bucket,
        f"t-{uuid.uuid4().hex[:8]}",
        endpoint_url=s3_server.endpoint,
        part_size=5 * MIB,
        client=s3_server.client(),
    )


def keys(client: Any, bucket: str, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for p in pages for o in p.get("Contents", []))


def open_uploads(client: Any, bucket: str, prefix: str) -> list[str]:
    return [
        u["Key"]
        for u in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    ]


def write(path: Path, data: bytes) -> UploadFile:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return UploadFile(path.name, path, hashlib.sha256(data).hexdigest())


def test_multipart_upload_ranges_and_sha256_metadata(store: S3Store, tmp_path: Path) -> None:
    big = os.urandom(12 * MIB + 12345)  # three parts of 5 MiB
    small = b"tiny file"
    files = [write(tmp_path / "big.bin", big), write(tmp_path / "small.json", small)]
    files = [UploadFile(f"native/{f.path}", f.local, f.sha256) for f in files]
    uri = store.attempt_uri("job1", "1.abc")
    assert store.upload(uri, files, should_stop=lambda: False)
    c = store.client
    head = c.head_object(Bucket=store.bucket, Key=f"{store.prefix}/job1/1.abc/native/big.bin")
    # A multipart object's ETag is "<md5 of md5s>-<parts>": the sha256 comes from the worker.
    assert head["ETag"].strip('"').endswith("-3")
    assert head["Metadata"]["sha256"] == hashlib.sha256(big).hexdigest()
    root = join_uri(uri, "native")
    assert store.stat(root, "big.bin") == len(big)
    assert b"".join(store.open_range(root, "big.bin", 0, len(big))) == big
    assert (
        b"".join(store.open_range(root, "big.bin", 5 * MIB - 3, 5 * MIB + 7))
        == big[5 * MIB - 3 : 5 * MIB + 7]
    )
    assert b"".join(store.open_range(root, "small.json", 2, 4)) == small[2:4]
    with pytest.raises(StoreObjectMissingError):
        store.stat(root, "nope.bin")
    with pytest.raises(StoreObjectMissingError):
        store.open_range(root, "nope.bin", 0, 1)
    assert open_uploads(c, store.bucket, store.prefix + "/") == []


def test_stop_between_files_leaves_nothing(store: S3Store, tmp_path: Path) -> None:
    files = [write(tmp_path / f"f{i}.bin", os.urandom(1000)) for i in range(3)]
    calls = iter([False, False, True])
    uri = store.attempt_uri("job2", "1.x")
    assert store.upload(uri, files, should_stop=lambda: next(calls)) is False
    assert keys(store.client, store.bucket, store.prefix + "/") == []


def test_clear_job_keeps_one_attempt_and_aborts_open_uploads(
    store: S3Store, tmp_path: Path
) -> None:
    f = [write(tmp_path / "a.bin", b"a" * 100)]
    old, new = store.attempt_uri("job3", "1.old"), store.attempt_uri("job3", "2.new")
    other = store.attempt_uri("job30", "1.x")  # a job whose id starts with the same text
    for uri in (old, new, other):
        assert store.upload(uri, f, should_stop=lambda: False)
    # What a killed worker leaves: a multipart upload never completed or aborted.
    c = store.client
    up = c.create_multipart_upload(Bucket=store.bucket, Key=f"{store.prefix}/job3/1.old/big.bin")
    c.upload_part(
        Bucket=store.bucket,
        Key=f"{store.prefix}/job3/1.old/big.bin",
        UploadId=up["UploadId"],
        PartNumber=1,
        Body=b"x" * (5 * MIB),
    )
    assert open_uploads(c, store.bucket, f"{store.prefix}/job3/") != []
    store.clear_job("job3", keep=new)
    assert keys(c, store.bucket, f"{store.prefix}/job3") == [
        f"{store.prefix}/job3/2.new/a.bin",
        f"{store.prefix}/job30/1.x/a.bin",
    ]
    assert open_uploads(c, store.bucket, f"{store.prefix}/job3/") == []
    store.clear_job("job3", keep=None)
    assert keys(c, store.bucket, f"{store.prefix}/job3/") == []
    assert keys(c, store.bucket, f"{store.prefix}/job30/") != []


def test_unreachable_and_misconfigured_stores_are_unavailable(s3_server: Any) -> None:
    dead = S3Store("higgs", "p", endpoint_url=f"http://127.0.0.1:{free_port()}", timeout_s=1)
    with pytest.raises(StoreUnavailableError) as e:
        dead.check()
    assert e.value.status == 503 and e.value.code == "storage_unavailable"
    no_bucket = S3Store(
        "no-such-bucket", "p", endpoint_url=s3_server.endpoint, client=s3_server.client()
    )
    with pytest.raises(StoreUnavailableError):
        no_bucket.check()
    # The server answers HEAD of a key in a missing bucket with a bare 404, as for a missing
    # key: still the store's fault (503), not a lost file (500).
    with pytest.raises(StoreUnavailableError):
        no_bucket.stat(no_bucket.attempt_uri("j", "1.a"), "native/w.bin")


def test_settings_refuse_a_non_s3_url(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="s3://bucket"):
        Settings(data_dir=tmp_path, artifacts_url="http://example/bucket")
    with pytest.raises(ValueError, match="s3://bucket"):
        Settings(data_dir=tmp_path, artifacts_url="s3:///no-bucket")


# ---------------------------------------------------------------- the API on an S3 store


@pytest.fixture
def s3_settings(
    sqlite_url: str, tmp_path: Path, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    return Settings(
        data_dir=tmp_path / "data",
        database_url=sqlite_url,
        models_dir=models,
        artifacts_url=f"s3://{s3_server.bucket}/api-{uuid.uuid4().hex[:8]}",
        s3_endpoint_url=s3_server.endpoint,
        s3_part_size_mb=5,
        s3_timeout_s=2,
    )


@pytest.fixture
def s3_client(s3_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(s3_settings)) as c:
        yield c


@pytest.fixture
def s3_job(
    s3_client: TestClient, s3_settings: Settings, tmp_path: Path
) -> tuple[str, dict[str, str], dict[str, bytes]]:
    """A succeeded job whose native artifact is in the S3 store (uploaded as the worker does)."""
    sessions: sessionmaker[Session] = s3_client.app.state.sessions  # type: ignore[attr-defined]
    with sessions() as s:
        _, key = create_key(s, "alice")
    auth = {"Authorization": f"Bearer {key}"}
    jid = s3_client.post("/v1/jobs", json=BODY, headers=auth).json()["id"]
    local = tmp_path / "out" / "native"
    files = {
        "config.json": b'{"model_type": "llama"}',
        "model.safetensors": os.urandom(6 * MIB + 17),
        "sub/tokenizer.json": b"{}" * 10,
        "empty.txt": b"",
    }
    for rel, data in files.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
    row = artifact_row("native", local)
    store = store_from_settings(s3_settings)
    uri = store.attempt_uri(jid, "1.test")
    ups = [UploadFile(f"native/{f.path}", local / f.path, f.sha256) for f in row.files]
    assert store.upload(uri, ups, should_stop=lambda: False)
    row = dataclasses.replace(row, uri=join_uri(uri, "native"))
    with sessions() as s:
        state.claim(s, jid, "w")
        state.succeed(s, jid, {"bits_per_weight": 4.1, "layers": []}, [], [row])
    return jid, auth, files


def url(jid: str, rest: str = "") -> str:
    return f"/v1/jobs/{jid}/artifacts/native{rest}"


def test_api_streams_s3_files_with_range_etag_and_digests(
    s3_client: TestClient, s3_job: Any
) -> None:
    jid, auth, files = s3_job
    listing = s3_client.get(url(jid), headers=auth).json()
    assert sorted(f["path"] for f in listing["files"]) == sorted(files)
    data = files["model.safetensors"]
    sha = hashlib.sha256(data).hexdigest()
    r = s3_client.get(url(jid, "/files/model.safetensors"), headers=auth)
    assert r.status_code == 200 and r.content == data
    assert r.headers["etag"] == f'"{sha}"' and r.headers["x-checksum-sha256"] == sha
    assert r.headers["content-length"] == str(len(data)) and r.headers["accept-ranges"] == "bytes"
    r = s3_client.get(
        url(jid, "/files/model.safetensors"), headers={**auth, "Range": "bytes=100-199"}
    )
    assert r.status_code == 206 and r.content == data[100:200]
    assert r.headers["content-range"] == f"bytes 100-199/{len(data)}"
    r = s3_client.get(url(jid, "/files/model.safetensors"), headers={**auth, "Range": "bytes=-5"})
    assert r.status_code == 206 and r.content == data[-5:]
    r = s3_client.get(
        url(jid, "/files/model.safetensors"), headers={**auth, "If-None-Match": f'"{sha}"'}
    )
    assert r.status_code == 304 and r.content == b""
    r = s3_client.head(url(jid, "/files/model.safetensors"), headers=auth)
    assert (
        r.status_code == 200 and r.content == b"" and r.headers["content-length"] == str(len(data))
    )
    r = s3_client.get(url(jid, "/files/empty.txt"), headers=auth)
    assert r.status_code == 200 and r.content == b""
    assert_problem(
        s3_client.get(
            url(jid, "/files/model.safetensors"), headers={**auth, "Range": f"bytes={len(data)}-"}
        ),
        416,
    )
    r = s3_client.get(url(jid, "/archive"), headers=auth)
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        assert sorted(tar.getnames()) == sorted(f"native/{p}" for p in files)
        for p, blob in files.items():
            member = tar.extractfile(f"native/{p}")
            assert member is not None and member.read() == blob


# slow: waits out the client's retries against a stopped S3 endpoint
@pytest.mark.slow
def test_lost_object_is_500_and_unreachable_store_is_503(
    s3_client: TestClient, s3_job: Any, s3_settings: Settings, s3_server: Any
) -> None:
    jid, auth, _ = s3_job
    store = store_from_settings(s3_settings)
    assert isinstance(store, S3Store)
    key = f"{store.prefix}/{jid}/1.test/native/config.json"
    s3_server.client().delete_object(Bucket=store.bucket, Key=key)
    body = assert_problem(s3_client.get(url(jid, "/files/config.json"), headers=auth), 500)
    assert body["code"] == "artifact_file_missing"
    assert_problem(s3_client.get(url(jid, "/archive"), headers=auth), 500)
    assert s3_client.get("/readyz").json()["checks"]["store"] == "ok"
    s3_server.pause()
    try:
        r = s3_client.get(url(jid, "/files/model.safetensors"), headers=auth)
        body = assert_problem(r, 503)
        assert body["code"] == "storage_unavailable" and r.headers["retry-after"]
        ready = s3_client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["store"] == "unavailable"
    finally:
        s3_server.resume()
    assert s3_client.get("/readyz").status_code == 200


def test_presigned_redirect(s3_settings: Settings, s3_job: Any, s3_client: TestClient) -> None:
    jid, auth, files = s3_job
    redirecting = s3_settings.model_copy(update={"artifacts_redirect": True})
    with TestClient(create_app(redirecting)) as c:
        r = c.get(url(jid, "/files/model.safetensors"), headers=auth, follow_redirects=False)
        assert r.status_code == 307
        data = files["model.safetensors"]
        assert r.headers["x-checksum-sha256"] == hashlib.sha256(data).hexdigest()
        # The presigned URL needs no API key and answers Range itself.
        got = httpx.get(r.headers["location"], headers={"Range": "bytes=10-19"})
        assert got.status_code == 206 and got.content == data[10:20]
        assert httpx.get(r.headers["location"]).content == data
        # Without an API key there is no redirect (nor anything else).
        assert (
            c.get(url(jid, "/files/model.safetensors"), follow_redirects=False).status_code == 401
        )
