"""Narrow unit tests of the S3 artifact store on moto's in-process S3 (no server, no network),
for what a real server does not let a test provoke or observe: the exact requests the store
sends (multipart threshold, part sizes, sha256 metadata, batch sizes), faults injected into one
call (a part that fails, an abort that fails, an interruption mid-part), credentials that are
refused, a read-only key, and the key layout. What a real S3 server does with the same calls
(ranged reads, open uploads a killed worker leaves, presigned URLs it serves) is tested on
SeaweedFS in tests/app/test_store_s3.py and tests/e2e."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from app.artifacts.store import (
    MIN_PART_BYTES,
    S3Store,
    StoreObjectMissingError,
    StoreUnavailableError,
    UploadFile,
    join_uri,
    parse_s3_url,
    store_from_settings,
)
from app.settings import Settings
from devtools.stack import free_port

MIB = 2**20
REGION = "us-east-1"


@pytest.fixture(autouse=True)
def fake_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Credentials that name nothing real, and no AWS configuration of the machine."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def mocked() -> Iterator[None]:
    with mock_aws():
        yield


def new_bucket() -> str:
    return f"higgs-unit-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def store(mocked: None) -> S3Store:
    """A store that builds its own boto3 client (the production configuration) on moto."""
    bucket = new_bucket()
    s = S3Store(bucket, "svc/artifacts", region=REGION, part_size=5 * MIB)
    s.client.create_bucket(Bucket=bucket)
    return s


class Calls:
    """The S3 operations a client sends, with their parameters (recorded before sending)."""

    def __init__(self, client: Any) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        client.meta.events.register("provide-client-params.s3.*", self._record)

    def _record(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        body = params.get("Body")
        size = len(body) if body is not None and hasattr(body, "__len__") else None
        self.seen.append((model.name, {**params, "BodySize": size}))

    def named(self, op: str, key: str | None = None) -> list[dict[str, Any]]:
        return [p for name, p in self.seen if name == op and (key is None or p["Key"] == key)]


def fail_once(client: Any, op: str, when: Callable[[dict[str, Any]], bool], code: str) -> list[int]:
    """Make the first call of `op` whose parameters satisfy `when` fail with an S3 error
    `code` (HTTP 500), as a store that drops one request would. Returns a list that gets one
    entry per injected failure."""
    fired: list[int] = []
    lock = threading.Lock()

    def hook(params: dict[str, Any], **_: Any) -> None:
        with lock:
            if fired or not when(params):
                return
            fired.append(1)
        raise ClientError(
            {
                "Error": {"Code": code, "Message": "injected"},
                "ResponseMetadata": {"HTTPStatusCode": 500},
            },
            op,
        )

    client.meta.events.register(f"provide-client-params.s3.{op}", hook)
    return fired


def keys(store: S3Store, prefix: str = "") -> list[str]:
    pages = store.client.get_paginator("list_objects_v2").paginate(
        Bucket=store.bucket, Prefix=prefix or store.prefix
    )
    return sorted(o["Key"] for p in pages for o in p.get("Contents", []))


def open_uploads(store: S3Store) -> list[str]:
    found = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    return [u["Key"] for u in found.get("Uploads", [])]


def upload_file(tmp: Path, rel: str, data: bytes) -> UploadFile:
    local = tmp / "out" / rel
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(data)
    return UploadFile(rel, local, hashlib.sha256(data).hexdigest())


# ---------------------------------------------------------------- multipart and sha256


def test_multipart_threshold_part_sizes_and_sha256_per_file(store: S3Store, tmp_path: Path) -> None:
    files = [
        upload_file(tmp_path, "native/model.safetensors", os.urandom(12 * MIB + 1)),
        upload_file(tmp_path, "native/exactly-one-part.bin", os.urandom(5 * MIB)),
        upload_file(tmp_path, "native/just-below.bin", os.urandom(5 * MIB - 1)),
        upload_file(tmp_path, "native/config.json", b'{"model_type": "llama"}'),
        upload_file(tmp_path, "dequantized/empty.txt", b""),
    ]
    calls = Calls(store.client)
    uri = store.attempt_uri("job-1", "1.abc")
    assert store.upload(uri, files, should_stop=lambda: False) is True

    def key(f: UploadFile) -> str:
        return f"svc/artifacts/job-1/1.abc/{f.path}"

    big, one, below, small, empty = files
    # At or above the part size: multipart, every part but the last exactly the part size.
    parts = sorted((p["PartNumber"], p["BodySize"]) for p in calls.named("UploadPart", key(big)))
    assert parts == [(1, 5 * MIB), (2, 5 * MIB), (3, 2 * MIB + 1)]
    assert [p["BodySize"] for p in calls.named("UploadPart", key(one))] == [5 * MIB]
    for f in (big, one):
        (create,) = calls.named("CreateMultipartUpload", key(f))
        assert create["Metadata"] == {"sha256": f.sha256}  # the part ETags say nothing of it
        assert len(calls.named("CompleteMultipartUpload", key(f))) == 1
        assert calls.named("PutObject", key(f)) == []
    # Below it: one PUT each, the empty file included.
    for f in (below, small, empty):
        (put,) = calls.named("PutObject", key(f))
        assert put["Metadata"] == {"sha256": f.sha256} and put["BodySize"] == f.local.stat().st_size
        assert calls.named("CreateMultipartUpload", key(f)) == []
    # Stored: the sha256 the worker computed, per file, whatever the upload's shape.
    for f in files:
        head = store.client.head_object(Bucket=store.bucket, Key=key(f))
        assert head["Metadata"]["sha256"] == f.sha256
        assert head["ContentLength"] == f.local.stat().st_size
    assert store.client.head_object(Bucket=store.bucket, Key=key(big))["ETag"].endswith('-3"')
    assert open_uploads(store) == []


def test_part_size_is_never_below_the_s3_minimum_and_follows_the_settings(
    mocked: None, tmp_path: Path
) -> None:
    assert (
        S3Store("b-min", "", region=REGION, part_size=1024).part_size == MIN_PART_BYTES == 5 * MIB
    )
    settings = Settings(
        data_dir=tmp_path, artifacts_url=f"s3://{new_bucket()}/p", s3_part_size_mb=7
    )
    configured = store_from_settings(settings)
    assert isinstance(configured, S3Store) and configured.part_size == 7 * MIB
    configured.client.create_bucket(Bucket=configured.bucket)
    calls = Calls(configured.client)
    f = upload_file(tmp_path, "native/w.bin", os.urandom(15 * MIB))
    assert configured.upload(configured.attempt_uri("j", "1.x"), [f], should_stop=lambda: False)
    sizes = sorted((p["PartNumber"], p["BodySize"]) for p in calls.named("UploadPart"))
    assert sizes == [(1, 7 * MIB), (2, 7 * MIB), (3, 1 * MIB)]


# ---------------------------------------------------------------- failures and cancel


@pytest.mark.parametrize("abort_fails", [False, True], ids=["abort-ok", "abort-fails-once"])
def test_a_failed_part_leaves_no_object_and_no_open_upload(
    store: S3Store, tmp_path: Path, abort_fails: bool
) -> None:
    """The second file's part 2 fails: the upload reports the store as unavailable, the first
    (complete) file is removed again, and the multipart upload is aborted, by the transfer
    manager or, when its own abort call is lost too, by the store's cleanup."""
    first = upload_file(tmp_path, "native/a.bin", os.urandom(6 * MIB))
    second = upload_file(tmp_path, "native/b.bin", os.urandom(11 * MIB))
    failed = fail_once(
        store.client,
        "UploadPart",
        lambda p: p["Key"].endswith("/b.bin") and p["PartNumber"] == 2,
        "InternalError",
    )
    aborts = (
        fail_once(store.client, "AbortMultipartUpload", lambda p: True, "InternalError")
        if abort_fails
        else []
    )
    calls = Calls(store.client)
    uri = store.attempt_uri("job-2", "1.abc")
    with pytest.raises(StoreUnavailableError) as err:
        store.upload(uri, [first, second], should_stop=lambda: False)
    assert err.value.code == "storage_unavailable" and err.value.status == 503
    assert failed == [1] and aborts == ([1] if abort_fails else [])
    # The failed upload was opened, and aborted (twice when the first abort was lost).
    assert len(calls.named("CreateMultipartUpload", "svc/artifacts/job-2/1.abc/native/b.bin")) == 1
    assert len(calls.named("AbortMultipartUpload")) >= (2 if abort_fails else 1)
    assert keys(store) == []
    assert open_uploads(store) == []


def test_cancel_between_files_removes_what_was_uploaded(store: S3Store, tmp_path: Path) -> None:
    files = [
        upload_file(tmp_path, "native/a.bin", os.urandom(6 * MIB)),  # multipart
        upload_file(tmp_path, "native/b.json", b"{}"),
        upload_file(tmp_path, "native/c.json", b"[]"),
    ]
    answers = iter([False, False, True])
    uri = store.attempt_uri("job-3", "1.abc")
    assert store.upload(uri, files, should_stop=lambda: next(answers)) is False
    assert keys(store) == [] and open_uploads(store) == []


class Interrupted(BaseException):
    """What a signal handler raises in the pool process's main thread (a revoke with
    terminate, a hard time limit): not an Exception, so nothing may swallow it."""


# slow: waits out retries of an interrupted upload
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_interruption_mid_part_aborts_the_open_upload(store: S3Store, tmp_path: Path) -> None:
    """A signal arrives while part 2 of a multipart file is on the wire: the upload re-raises
    it after removing every object of the attempt and aborting the multipart upload."""
    done = upload_file(tmp_path, "native/config.json", b"{}")
    big = upload_file(tmp_path, "native/model.safetensors", os.urandom(16 * MIB))
    main_raised = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        main_raised.set()
        raise Interrupted(f"signal {signum}")

    def mid_part(params: dict[str, Any], **_: Any) -> None:
        if params["Key"].endswith("model.safetensors") and params["PartNumber"] == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
            main_raised.wait(10)  # the part completes only after the main thread was hit

    store.client.meta.events.register("provide-client-params.s3.UploadPart", mid_part)
    old = signal.signal(signal.SIGUSR1, on_signal)
    try:
        with pytest.raises(Interrupted):
            store.upload(
                store.attempt_uri("job-4", "1.abc"), [done, big], should_stop=lambda: False
            )
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert main_raised.is_set()
    assert keys(store) == [] and open_uploads(store) == []


def test_delete_tree_aborts_uploads_a_killed_worker_left_open_and_batches_deletes(
    store: S3Store,
) -> None:
    """1001 objects (more than one DeleteObjects call may name) and an open multipart upload
    under one attempt: all removed, in batches of at most 1000 keys; a neighbour stays."""
    uri = store.attempt_uri("job-5", "1.abc")
    root = uri.removeprefix(f"s3://{store.bucket}/")
    for i in range(1001):
        store.client.put_object(Bucket=store.bucket, Key=f"{root}/native/f{i:04d}", Body=b"x")
    store.client.put_object(
        Bucket=store.bucket, Key="svc/artifacts/job-5/2.def/native/k", Body=b"k"
    )
    up = store.client.create_multipart_upload(Bucket=store.bucket, Key=f"{root}/native/big.bin")
    store.client.upload_part(
        Bucket=store.bucket,
        Key=f"{root}/native/big.bin",
        UploadId=up["UploadId"],
        PartNumber=1,
        Body=b"x" * (5 * MIB),
    )
    calls = Calls(store.client)
    store.delete_tree(uri)
    batches = [len(p["Delete"]["Objects"]) for p in calls.named("DeleteObjects")]
    assert sorted(batches) == [1, 1000]
    assert keys(store) == ["svc/artifacts/job-5/2.def/native/k"]
    assert open_uploads(store) == []


# ---------------------------------------------------------------- parts written side by side


def test_put_writes_beside_what_is_there_and_a_stop_removes_nothing(
    store: S3Store, tmp_path: Path
) -> None:
    """put (the parts of a fanned-out job writing into one attempt's artifact location): a
    sibling's object stays, each file carries its sha256, a same-path file is replaced, and a
    stop between files keeps what was written (the part's next run writes the same keys)."""
    uri = store.attempt_uri("job-p", "1.parts")
    root = uri.removeprefix(f"s3://{store.bucket}/")
    store.client.put_object(Bucket=store.bucket, Key=f"{root}/native/sibling", Body=b"s")
    mine = [
        upload_file(tmp_path, "native/model-00002-of-00003.safetensors", os.urandom(6 * MIB)),
        upload_file(tmp_path, "dequantized/model-00002-of-00002.safetensors", b"d" * 100),
    ]
    assert store.put(uri, mine, should_stop=lambda: False) is True
    assert keys(store) == sorted([f"{root}/native/sibling", *(f"{root}/{f.path}" for f in mine)])
    for f in mine:
        head = store.client.head_object(Bucket=store.bucket, Key=f"{root}/{f.path}")
        assert head["Metadata"]["sha256"] == f.sha256
    again = upload_file(tmp_path / "2", "dequantized/model-00002-of-00002.safetensors", b"e" * 9)
    answers = iter([False, True])
    assert store.put(uri, [again, mine[0]], should_stop=lambda: next(answers)) is False
    got = store.client.get_object(Bucket=store.bucket, Key=f"{root}/{again.path}")
    assert got["Body"].read() == b"e" * 9
    assert len(keys(store)) == 3 and open_uploads(store) == []


def test_a_failed_put_aborts_its_upload_and_leaves_the_siblings(
    store: S3Store, tmp_path: Path
) -> None:
    uri = store.attempt_uri("job-q", "1.parts")
    root = uri.removeprefix(f"s3://{store.bucket}/")
    store.client.put_object(Bucket=store.bucket, Key=f"{root}/native/sibling", Body=b"s")
    first = upload_file(tmp_path, "native/a.bin", b"a" * 10)
    big = upload_file(tmp_path, "dequantized/b.bin", os.urandom(11 * MIB))
    failed = fail_once(store.client, "UploadPart", lambda p: p["PartNumber"] == 2, "InternalError")
    with pytest.raises(StoreUnavailableError):
        store.put(uri, [first, big], should_stop=lambda: False)
    assert failed == [1]
    assert keys(store) == [f"{root}/native/a.bin", f"{root}/native/sibling"]
    assert open_uploads(store) == []


def test_abort_uploads_aborts_only_under_the_root_and_keeps_objects(store: S3Store) -> None:
    """What a lost part run left open under the attempt's artifact location is aborted before
    publication; objects and other attempts' uploads stay."""
    uri = store.attempt_uri("job-r", "1.parts")
    root = uri.removeprefix(f"s3://{store.bucket}/")
    store.client.put_object(Bucket=store.bucket, Key=f"{root}/native/done", Body=b"x")
    for key in (f"{root}/native/half.bin", "svc/artifacts/job-r/2.parts/native/other.bin"):
        store.client.create_multipart_upload(Bucket=store.bucket, Key=key)
    store.abort_uploads(uri)
    assert keys(store) == [f"{root}/native/done"]
    assert open_uploads(store) == ["svc/artifacts/job-r/2.parts/native/other.bin"]


def test_local_put_renames_into_place_beside_what_is_there(tmp_path: Path) -> None:
    """The local store's put is one rename per file (same inode, the local file gone), a
    sibling stays, a stop between files keeps what was placed."""
    from app.artifacts.store import LocalStore, uri_path

    store = LocalStore(tmp_path / "artifacts")
    uri = store.attempt_uri("job-l", "1.parts")
    (uri_path(uri) / "native").mkdir(parents=True)
    (uri_path(uri) / "native" / "sibling").write_bytes(b"s")
    a = upload_file(tmp_path, "native/model-00001-of-00002.safetensors", b"a" * 10)
    b = upload_file(tmp_path, "dequantized/model-00001-of-00001.safetensors", b"b" * 10)
    inode = a.local.stat().st_ino
    answers = iter([False, True])
    assert store.put(uri, [a, b], should_stop=lambda: next(answers)) is False
    placed = uri_path(uri) / a.path
    assert placed.stat().st_ino == inode and not a.local.exists()
    assert b.local.exists() and not (uri_path(uri) / b.path).exists()
    assert store.put(uri, [b], should_stop=lambda: False) is True
    assert sorted(p.relative_to(uri_path(uri)).as_posix() for p in uri_path(uri).rglob("*.*")) == [
        b.path,
        a.path,
    ]
    assert (uri_path(uri) / "native" / "sibling").read_bytes() == b"s"


# ---------------------------------------------------------------- publication


def test_an_object_is_visible_only_once_complete(store: S3Store, tmp_path: Path) -> None:
    """While a multipart file is uploading its key lists nothing and reads 404 (S3 shows an
    object only after CompleteMultipartUpload): no reader ever sees half a file, and nothing
    names the attempt's keys before the job's success publishes its rows."""
    first = upload_file(tmp_path, "native/config.json", b'{"a": 1}')
    big = upload_file(tmp_path, "native/model.safetensors", os.urandom(11 * MIB))
    uri = store.attempt_uri("job-6", "1.abc")
    seen: list[tuple[list[str], str]] = []

    def during_part(params: dict[str, Any], **_: Any) -> None:
        # Runs in a transfer thread: record, assert in the test's thread.
        if params["Key"].endswith("model.safetensors") and params["PartNumber"] == 2:
            listed = keys(store, "svc/artifacts/job-6/")
            try:
                outcome = f"{store.stat(join_uri(uri, 'native'), 'model.safetensors')} bytes"
            except StoreObjectMissingError as e:
                outcome = e.code
            seen.append((listed, outcome))

    store.client.meta.events.register("provide-client-params.s3.UploadPart", during_part)
    assert store.upload(uri, [first, big], should_stop=lambda: False)
    assert seen == [(["svc/artifacts/job-6/1.abc/native/config.json"], "artifact_file_missing")]
    assert store.stat(join_uri(uri, "native"), "model.safetensors") == 11 * MIB


# ---------------------------------------------------------------- key layout


@pytest.mark.parametrize(
    ("url", "bucket", "prefix", "attempt_root"),
    [
        ("s3://bkt-a/svc/artifacts", "bkt-a", "svc/artifacts", "svc/artifacts/J/2.ab"),
        ("s3://bkt-a/svc/artifacts/", "bkt-a", "svc/artifacts", "svc/artifacts/J/2.ab"),
        ("s3://bkt-a", "bkt-a", "", "J/2.ab"),
        ("s3://bkt-a/", "bkt-a", "", "J/2.ab"),
    ],
)
def test_key_layout(url: str, bucket: str, prefix: str, attempt_root: str, mocked: None) -> None:
    assert parse_s3_url(url) == (bucket, prefix)
    s = S3Store(bucket, prefix, region=REGION)
    uri = s.attempt_uri("J", "2.ab")
    assert uri == f"s3://{bucket}/{attempt_root}"
    # A format's root and a file below it: <prefix>/<job>/<attempt>/<format>/<path>
    root = join_uri(uri, "native")
    assert s._object(root, "sub/tokenizer.json") == (
        bucket,
        f"{attempt_root}/native/sub/tokenizer.json",
    )


def test_uploaded_keys_follow_the_layout_and_clear_job_keeps_other_jobs(
    store: S3Store, tmp_path: Path
) -> None:
    files = [
        upload_file(tmp_path, "native/model.safetensors", b"w" * 100),
        upload_file(tmp_path, "native/sub dir/tokenizer ü.json", b"{}"),
        upload_file(tmp_path, "dequantized/model.safetensors", b"d" * 50),
    ]
    for job, attempt in (("job-7", "1.old"), ("job-7", "2.new"), ("job-70", "1.x")):
        assert store.upload(store.attempt_uri(job, attempt), files, should_stop=lambda: False)
    layout = [f"svc/artifacts/job-7/2.new/{f.path}" for f in files]
    assert set(layout) <= set(keys(store))
    store.clear_job("job-7", keep=store.attempt_uri("job-7", "2.new"))
    assert keys(store) == sorted(layout + [f"svc/artifacts/job-70/1.x/{f.path}" for f in files])


# ---------------------------------------------------------------- presigned URLs


def test_presigned_url_shape_on_a_custom_endpoint(
    mocked: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAPRESIGNTEST00000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "presign-secret-value")
    s = S3Store("bkt-p", "svc", endpoint_url="http://127.0.0.1:8333", region=REGION)
    uri = join_uri(s.attempt_uri("job-8", "1.abc"), "native")
    url = s.presigned_url(uri, "sub dir/model ü.safetensors", expires_s=600)
    assert url is not None
    parts = urlsplit(url)
    # Path-style on a custom endpoint: the bucket is the first path segment, the key quoted.
    assert (parts.scheme, parts.netloc) == ("http", "127.0.0.1:8333")
    assert parts.path == "/bkt-p/svc/job-8/1.abc/native/sub%20dir/model%20%C3%BC.safetensors"
    q = {k: v[0] for k, v in parse_qs(parts.query).items()}
    assert q["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256"
    assert q["X-Amz-Expires"] == "600"
    assert q["X-Amz-SignedHeaders"] == "host"
    cred = q["X-Amz-Credential"].split("/")
    assert cred[0] == "AKIAPRESIGNTEST00000" and cred[2:] == [REGION, "s3", "aws4_request"]
    assert re.fullmatch(r"[0-9a-f]{64}", q["X-Amz-Signature"])
    assert "presign-secret-value" not in url
    # Another lifetime is another signature.
    other = s.presigned_url(uri, "sub dir/model ü.safetensors", expires_s=60)
    assert other is not None
    oq = {k: v[0] for k, v in parse_qs(urlsplit(other).query).items()}
    assert oq["X-Amz-Expires"] == "60" and oq["X-Amz-Signature"] != q["X-Amz-Signature"]


def test_presigned_url_on_aws_is_https_and_names_bucket_and_key(mocked: None) -> None:
    s = S3Store("bkt-aws", "p", region=REGION)
    url = s.presigned_url(join_uri(s.attempt_uri("j", "1.a"), "native"), "m.bin", expires_s=30)
    assert url is not None
    parts = urlsplit(url)
    assert parts.scheme == "https"
    assert (parts.netloc, parts.path) == ("bkt-aws.s3.amazonaws.com", "/p/j/1.a/native/m.bin")


# ---------------------------------------------------------------- error mapping


def every_operation(s: S3Store, tmp: Path) -> dict[str, Callable[[], object]]:
    root = join_uri(s.attempt_uri("job-9", "1.abc"), "native")
    f = upload_file(tmp, "native/w.bin", os.urandom(6 * MIB))
    small = upload_file(tmp, "native/c.json", b"{}")
    return {
        "check": s.check,
        "stat": lambda: s.stat(root, "w.bin"),
        "open_range": lambda: s.open_range(root, "w.bin", 0, 10),
        "upload_multipart": lambda: s.upload(
            s.attempt_uri("job-9", "1.abc"), [f], should_stop=lambda: False
        ),
        "upload_single": lambda: s.upload(
            s.attempt_uri("job-9", "1.abc"), [small], should_stop=lambda: False
        ),
        "delete_tree": lambda: s.delete_tree(s.attempt_uri("job-9", "1.abc")),
        "clear_job": lambda: s.clear_job("job-9", keep=None),
    }


OPERATIONS = [
    "check",
    "stat",
    "open_range",
    "upload_multipart",
    "upload_single",
    "delete_tree",
    "clear_job",
]


def assert_unavailable(call: Callable[[], object], secret: str | None = None) -> None:
    with pytest.raises(StoreUnavailableError) as err:
        call()
    assert err.value.status == 503 and err.value.code == "storage_unavailable"
    if secret is not None:
        assert secret not in str(err.value)


@pytest.mark.parametrize("op", OPERATIONS)
def test_unreachable_endpoint_is_storage_unavailable(op: str, tmp_path: Path) -> None:
    s = S3Store(
        "higgs", "p", endpoint_url=f"http://127.0.0.1:{free_port()}", region=REGION, timeout_s=1
    )
    assert_unavailable(every_operation(s, tmp_path)[op])


@pytest.mark.parametrize("op", OPERATIONS)
def test_missing_bucket_is_storage_unavailable(op: str, mocked: None, tmp_path: Path) -> None:
    s = S3Store(new_bucket(), "p", region=REGION)
    assert_unavailable(every_operation(s, tmp_path)[op])


def test_stat_tells_a_missing_bucket_from_a_missing_key(mocked: None) -> None:
    """A HEAD answer has no body, so a real server's 404 for a missing bucket carries no code
    (moto's has one): the store asks about the bucket before calling a 404 a missing file."""
    s = S3Store(new_bucket(), "p", region=REGION)

    def bare_404(params: dict[str, Any], **_: Any) -> None:
        raise ClientError(
            {
                "Error": {"Code": "404", "Message": "Not Found"},
                "ResponseMetadata": {"HTTPStatusCode": 404},
            },
            "HeadObject",
        )

    s.client.meta.events.register("provide-client-params.s3.HeadObject", bare_404)
    root = join_uri(s.attempt_uri("j", "1.a"), "native")
    assert_unavailable(lambda: s.stat(root, "w.bin"))
    s.client.create_bucket(Bucket=s.bucket)
    with pytest.raises(StoreObjectMissingError):
        s.stat(root, "w.bin")


@pytest.fixture
def iam_key(mocked: None) -> dict[str, str]:
    """An access key for the S3 actions `allow` (moto checks keys and policies once asked to)."""
    import boto3

    def make(allow: list[str]) -> dict[str, str]:
        iam = boto3.client("iam", region_name=REGION)
        name = f"u-{uuid.uuid4().hex[:6]}"
        iam.create_user(UserName=name)
        doc = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": allow, "Resource": "*"}],
        }
        iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=json.dumps(doc))
        k = iam.create_access_key(UserName=name)["AccessKey"]
        return {"id": k["AccessKeyId"], "secret": k["SecretAccessKey"]}

    return {
        "full": json.dumps(make(["s3:*"])),
        "read": json.dumps(make(["s3:Get*", "s3:List*", "s3:HeadBucket"])),
    }


def with_keys(monkeypatch: pytest.MonkeyPatch, key_id: str, secret: str, bucket: str) -> S3Store:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    return S3Store(bucket, "p", region=REGION)


@pytest.mark.parametrize("op", OPERATIONS)
@pytest.mark.parametrize("bad", ["unknown-key", "wrong-secret"])
def test_refused_credentials_are_storage_unavailable(
    op: str, bad: str, iam_key: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from moto.core import set_initial_no_auth_action_count

    full = json.loads(iam_key["full"])
    bucket = new_bucket()

    @set_initial_no_auth_action_count(0)
    def run() -> None:
        owner = with_keys(monkeypatch, full["id"], full["secret"], bucket)
        owner.client.create_bucket(Bucket=bucket)
        owner.check()  # the right key works
        if bad == "unknown-key":
            s = with_keys(monkeypatch, "AKIAUNKNOWN000000000", "whatever-secret", bucket)
            secret = "whatever-secret"
        else:
            s = with_keys(monkeypatch, full["id"], "a-wrong-secret", bucket)
            secret = "a-wrong-secret"
        assert_unavailable(every_operation(s, tmp_path)[op], secret)

    run()


@pytest.mark.parametrize("multipart", [False, True], ids=["single", "multipart"])
def test_a_read_only_key_fails_the_upload_as_storage_unavailable(
    multipart: bool, iam_key: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The bucket check passes (reads are allowed) but writes are refused: the upload fails
    with storage_unavailable, not as an error of the job's own."""
    from moto.core import set_initial_no_auth_action_count

    full, read = json.loads(iam_key["full"]), json.loads(iam_key["read"])
    bucket = new_bucket()

    @set_initial_no_auth_action_count(0)
    def run() -> None:
        with_keys(monkeypatch, full["id"], full["secret"], bucket).client.create_bucket(
            Bucket=bucket
        )
        s = with_keys(monkeypatch, read["id"], read["secret"], bucket)
        s.check()
        f = upload_file(tmp_path, "native/w.bin", os.urandom(6 * MIB if multipart else 10))
        assert_unavailable(
            lambda: s.upload(s.attempt_uri("j", "1.a"), [f], should_stop=lambda: False)
        )

    run()
