"""Artifact listing, whole and ranged downloads with digests, tar archives, path safety.

Artifact rows and files are inserted directly through app.jobs.state.succeed (the worker's
real path is covered by tests/e2e)."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.download import TarMember, parse_range, tar_size, tar_stream
from app.artifacts.manifest import artifact_row, manifest_sha256
from app.errors import RangeNotSatisfiableError
from app.jobs import state
from tests.fixtures import assert_problem

BODY = {"model": {"id": "tiny"}, "target": {"bits": 4}}


def make_files(root: Path) -> dict[str, bytes]:
    rng = __import__("random").Random(0)
    files = {
        "config.json": b'{"model_type": "llama"}',
        "model.safetensors": bytes(rng.getrandbits(8) for _ in range(300_000)),
        "sub/dir/tokenizer.json": b"{}" * 10,
        "empty.txt": b"",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


@pytest.fixture
def done_job(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session], tmp_path: Path
) -> tuple[str, dict[str, bytes], Path]:
    jid = client.post("/v1/jobs", json=BODY, headers=auth).json()["id"]
    root = tmp_path / "store" / jid / "native"
    files = make_files(root)
    (tmp_path / "store" / jid / "secret.txt").write_text("TOP-SECRET")
    with sessions() as s:
        state.claim(s, jid, "w")
        state.succeed(
            s, jid, {"bits_per_weight": 4.1, "layers": []}, [], [artifact_row("native", root)]
        )
    return jid, files, root


def url(jid: str, rest: str = "") -> str:
    return f"/v1/jobs/{jid}/artifacts/native{rest}"


def test_listing_and_job_view(client: TestClient, auth: dict[str, str], done_job: Any) -> None:
    jid, files, _ = done_job
    r = client.get(url(jid), headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["format"] == "native" and body["bytes"] == sum(map(len, files.values()))
    listed = {f["path"]: f for f in body["files"]}
    assert set(listed) == set(files)
    for path, data in files.items():
        assert listed[path]["bytes"] == len(data)
        assert listed[path]["sha256"] == hashlib.sha256(data).hexdigest()
        assert listed[path]["url"] == url(jid, f"/files/{path}")
    expected = manifest_sha256((p, hashlib.sha256(d).hexdigest()) for p, d in files.items())
    assert body["sha256"] == expected
    job = client.get(f"/v1/jobs/{jid}", headers=auth).json()
    assert job["artifacts"] == [
        {"format": "native", "url": url(jid), "bytes": body["bytes"], "sha256": expected}
    ]
    # No dequantized artifact for this job.
    assert_problem(client.get(f"/v1/jobs/{jid}/artifacts/dequantized", headers=auth), 404)


def test_whole_file_download_with_digests(
    client: TestClient, auth: dict[str, str], done_job: Any
) -> None:
    jid, files, _ = done_job
    data = files["model.safetensors"]
    sha = hashlib.sha256(data).hexdigest()
    r = client.get(url(jid, "/files/model.safetensors"), headers=auth)
    assert r.status_code == 200
    assert r.content == data
    assert r.headers["content-length"] == str(len(data))
    assert r.headers["accept-ranges"] == "bytes"
    assert r.headers["etag"] == f'"{sha}"'
    assert r.headers["x-checksum-sha256"] == sha
    assert r.headers["repr-digest"] == f"sha-256=:{base64.b64encode(bytes.fromhex(sha)).decode()}:"
    nested = client.get(url(jid, "/files/sub/dir/tokenizer.json"), headers=auth)
    assert nested.content == files["sub/dir/tokenizer.json"]
    # Every artifact file is served as bytes (the one content type the API documents).
    assert nested.headers["content-type"] == "application/octet-stream"
    empty = client.get(url(jid, "/files/empty.txt"), headers=auth)
    assert (
        empty.status_code == 200 and empty.content == b"" and empty.headers["content-length"] == "0"
    )
    # Conditional GET.
    assert (
        client.get(
            url(jid, "/files/model.safetensors"), headers={**auth, "If-None-Match": f'"{sha}"'}
        ).status_code
        == 304
    )
    head = client.head(url(jid, "/files/model.safetensors"), headers=auth)
    assert (
        head.status_code == 200
        and head.headers["content-length"] == str(len(data))
        and head.content == b""
    )


def test_range_requests(client: TestClient, auth: dict[str, str], done_job: Any) -> None:
    jid, files, _ = done_job
    data = files["model.safetensors"]
    n = len(data)
    path = url(jid, "/files/model.safetensors")
    for header, (start, end) in {
        "bytes=0-99": (0, 100),
        "bytes=1000-": (1000, n),
        "bytes=-500": (n - 500, n),
        f"bytes=100-{n + 1000}": (100, n),
        f"bytes={n - 1}-{n - 1}": (n - 1, n),
    }.items():
        r = client.get(path, headers={**auth, "Range": header})
        assert r.status_code == 206, (header, r.text)
        assert r.content == data[start:end]
        assert r.headers["content-range"] == f"bytes {start}-{end - 1}/{n}"
        assert r.headers["content-length"] == str(end - start)
        assert (
            r.headers["x-checksum-sha256"] == hashlib.sha256(data).hexdigest()
        )  # of the whole file
    # Resume: a partial download + the rest by Range equals the file.
    first = client.get(path, headers={**auth, "Range": "bytes=0-12344"}).content
    rest = client.get(path, headers={**auth, "Range": f"bytes={len(first)}-"}).content
    assert first + rest == data
    for bad in [
        f"bytes={n}-",
        f"bytes={n + 5}-{n + 10}",
        "bytes=500-100",
        "bytes=-0",
        "bytes=abc",
        "bytes=-",
    ]:
        r = client.get(path, headers={**auth, "Range": bad})
        assert_problem(r, 416)
        assert r.headers["content-range"] == f"bytes */{n}"
    # Other units / several ranges are ignored: the whole file, 200.
    for ignored in ["items=0-5", "bytes=0-1,5-6"]:
        r = client.get(path, headers={**auth, "Range": ignored})
        assert r.status_code == 200 and r.content == data
    # If-Range with a stale validator sends the whole file.
    r = client.get(path, headers={**auth, "Range": "bytes=0-9", "If-Range": '"stale"'})
    assert r.status_code == 200 and len(r.content) == n
    r = client.get(path, headers={**auth, "Range": "bytes=0-9", "If-Range": r.headers["etag"]})
    assert r.status_code == 206 and r.content == data[:10]


def test_path_traversal_and_unlisted_files_refused(
    client: TestClient, auth: dict[str, str], done_job: Any
) -> None:
    jid, _, root = done_job
    # httpx resolves literal dot segments itself, so these reach the server as other routes;
    # percent-encoded ones reach the route with '..' in the path and must be refused there.
    for bad in [
        "../secret.txt",
        "sub/../../secret.txt",
        "%2e%2e/secret.txt",
        "..%2Fsecret.txt",
        "sub//dir/tokenizer.json",
    ]:
        r = client.get(url(jid, f"/files/{bad}"), headers=auth)
        assert r.status_code in (400, 404), (bad, r.status_code)
        assert r.headers["content-type"].startswith("application/problem+json")
        assert b"TOP-SECRET" not in r.content
    for bad in [
        "%2e%2e/secret.txt",
        "..%2Fsecret.txt",
        "sub//dir/tokenizer.json",
        "sub%2F..%2F..%2Fsecret.txt",
    ]:
        body = assert_problem(client.get(url(jid, f"/files/{bad}"), headers=auth), 400)
        assert "'..'" in body["detail"]
    # A file on disk but not in the manifest is not served.
    (root / "extra.bin").write_bytes(b"x")
    assert_problem(client.get(url(jid, "/files/extra.bin"), headers=auth), 404)
    # A symlink swapped in for a listed file that points outside is refused.
    os.remove(root / "config.json")
    os.symlink(root.parent / "secret.txt", root / "config.json")
    r = client.get(url(jid, "/files/config.json"), headers=auth)
    assert r.status_code == 404 and b"TOP-SECRET" not in r.content


def test_missing_store_file_is_a_clear_500(
    client: TestClient, auth: dict[str, str], done_job: Any
) -> None:
    jid, _, root = done_job
    (root / "config.json").unlink()
    body = assert_problem(client.get(url(jid, "/files/config.json"), headers=auth), 500)
    assert body["code"] == "artifact_file_missing"


def test_archive_is_a_tar_of_the_artifact(
    client: TestClient, auth: dict[str, str], done_job: Any
) -> None:
    jid, files, _ = done_job
    r = client.get(url(jid, "/archive"), headers=auth)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/x-tar"
    assert int(r.headers["content-length"]) == len(r.content)
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        names = tar.getnames()
        assert sorted(names) == sorted(f"native/{p}" for p in files)
        for p, data in files.items():
            member = tar.extractfile(f"native/{p}")
            assert member is not None and member.read() == data


def test_artifacts_of_unfinished_jobs_are_404(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    jid = client.post("/v1/jobs", json=BODY, headers=auth).json()["id"]
    body = assert_problem(client.get(url(jid), headers=auth), 404)
    assert "queued" in body["detail"]
    assert_problem(client.get(url(jid, "/archive"), headers=auth), 404)
    assert_problem(client.get(url(jid, "/files/config.json"), headers=auth), 404)


def test_parse_range_unit() -> None:
    assert parse_range(None, 10) is None
    assert parse_range("bytes=2-4", 10) == (2, 5)
    assert parse_range("bytes=-3", 10) == (7, 10)
    assert parse_range("bytes=-30", 10) == (0, 10)
    with pytest.raises(RangeNotSatisfiableError):
        parse_range("bytes=0-0", 0)


def test_tar_size_matches_stream_for_long_names(tmp_path: Path) -> None:
    long = "d" * 120 + "/" + "f" * 150 + ".bin"
    (tmp_path / long).parent.mkdir(parents=True)
    (tmp_path / long).write_bytes(b"z" * 1000)
    members = [TarMember(name=f"native/{long}", path=tmp_path / long, size=1000)]
    blob = b"".join(tar_stream(members, 0))
    assert len(blob) == tar_size(members, 0)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        assert tar.getnames() == [f"native/{long}"]


def test_conditional_requests_star_and_weak_validators(
    client: TestClient, auth: dict[str, str], done_job: Any
) -> None:
    jid, files, _ = done_job
    path = url(jid, "/files/model.safetensors")
    etag = client.get(path, headers=auth).headers["etag"]
    for header in ("*", f"W/{etag}", f'"nope", {etag}', f'"x", W/{etag}'):
        r = client.get(path, headers={**auth, "If-None-Match": header})
        assert r.status_code == 304 and r.content == b"", (header, r.status_code)
        assert r.headers["etag"] == etag
    r = client.get(path, headers={**auth, "If-None-Match": '"other"'})
    assert r.status_code == 200 and r.content == files["model.safetensors"]
    # If-Range needs a strong match: a weak tag means "send it all".
    r = client.get(path, headers={**auth, "Range": "bytes=0-9", "If-Range": f"W/{etag}"})
    assert r.status_code == 200 and len(r.content) == len(files["model.safetensors"])
    arch = url(jid, "/archive")
    arch_etag = client.get(arch, headers=auth).headers["etag"]
    assert client.get(arch, headers={**auth, "If-None-Match": "*"}).status_code == 304
    assert client.get(arch, headers={**auth, "If-None-Match": f"W/{arch_etag}"}).status_code == 304


@pytest.mark.parametrize("unit", ["BYTES", "Bytes", "bytes"])
def test_range_unit_is_case_insensitive(
    client: TestClient, auth: dict[str, str], done_job: Any, unit: str
) -> None:
    jid, files, _ = done_job
    r = client.get(url(jid, "/files/model.safetensors"), headers={**auth, "Range": f"{unit}=10-19"})
    assert r.status_code == 206, r.text
    assert r.content == files["model.safetensors"][10:20]


def test_head_on_every_get_endpoint(
    client: TestClient, auth: dict[str, str], done_job: Any
) -> None:
    jid, _files, _ = done_job
    for path in (
        url(jid, "/archive"),
        url(jid, "/files/model.safetensors"),
        url(jid),
        f"/v1/jobs/{jid}",
        "/v1/jobs",
        f"/v1/jobs/{jid}/report",
        f"/v1/jobs/{jid}/events",
        "/healthz",
    ):
        get = client.get(path, headers=auth)
        head = client.head(path, headers=auth)
        assert head.status_code == 200, (path, head.status_code, head.text)
        assert head.content == b""
        assert head.headers["content-type"] == get.headers["content-type"], path
        if "content-length" in get.headers and path != f"/v1/jobs/{jid}/events":
            assert head.headers["content-length"] == get.headers["content-length"], path
    assert client.head(url(jid, "/archive")).status_code == 401
    assert client.head(f"/v1/jobs/{jid}-nope", headers=auth).status_code == 404


def test_options_and_405_list_get_with_head(
    client: TestClient, auth: dict[str, str], done_job: Any
) -> None:
    jid, _, _ = done_job
    r = client.options(url(jid, "/files/model.safetensors"))
    assert r.status_code == 204
    assert [m.strip() for m in r.headers["allow"].split(",")] == ["GET", "HEAD", "OPTIONS"]
    r = client.options("/v1/jobs")
    assert {m.strip() for m in r.headers["allow"].split(",")} == {"GET", "HEAD", "POST", "OPTIONS"}
    r = client.put(url(jid, "/archive"), headers=auth)
    assert_problem(r, 405)
    assert {m.strip() for m in r.headers["allow"].split(",")} == {"GET", "HEAD", "OPTIONS"}
    assert_problem(client.options("/no/such/route"), 404)
