"""Signed archive links (a plain <a href> can use them; the API key never goes into a URL) and
the console's static files."""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.manifest import artifact_row
from app.jobs import state
from app.keys.service import revoke_key
from app.main import create_app
from app.settings import Settings
from tests.app.factories import make_job, make_key
from tests.fixtures import assert_problem


def _succeeded_job(sessions: sessionmaker[Session], key_id: str, root: Path) -> str:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"a": 1}')
    (root / "model.safetensors").write_bytes(b"\x01" * 1000)
    with sessions() as s:
        job = make_job(s, key_id)
        state.claim(s, job.id, "w")
        state.succeed(
            s, job.id, {"layers": []}, artifacts=[artifact_row("native", root)], worker_id="w"
        )
        return job.id


def test_signed_archive_link(
    settings: Settings,
    sessions: sessionmaker[Session],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with sessions() as s:
        row, key = make_key(s, "alice")
        _other_row, other = make_key(s, "bob")
    job_id = _succeeded_job(sessions, row.id, tmp_path / "art")
    auth = {"Authorization": f"Bearer {key}"}
    with TestClient(create_app(settings)) as c:
        assert_problem(c.post(f"/v1/jobs/{job_id}/artifacts/native/link"), 401)
        assert_problem(
            c.post(
                f"/v1/jobs/{job_id}/artifacts/native/link",
                headers={"Authorization": f"Bearer {other}"},
            ),
            404,
        )
        assert_problem(c.post(f"/v1/jobs/{job_id}/artifacts/dequantized/link", headers=auth), 404)
        r = c.post(f"/v1/jobs/{job_id}/artifacts/native/link", headers=auth)
        assert r.status_code == 200, r.text
        url: str = r.json()["url"]
        assert key not in url and "token=" in url and r.json()["expires_at"] > time.time()

        got = c.get(url)  # no Authorization header
        assert got.status_code == 200, got.text
        assert got.headers["referrer-policy"] == "no-referrer"
        with tarfile.open(fileobj=io.BytesIO(got.content)) as tar:
            assert sorted(tar.getnames()) == ["native/config.json", "native/model.safetensors"]
        # The header still works, and wins over a token.
        assert c.get(f"/v1/jobs/{job_id}/artifacts/native/archive", headers=auth).status_code == 200

        token = url.split("token=", 1)[1]
        assert_problem(c.get(f"/v1/jobs/{job_id}/artifacts/dequantized/archive?token={token}"), 401)
        assert_problem(c.get(f"/v1/jobs/{job_id}/artifacts/native/archive?token={token}x"), 401)
        assert_problem(c.get(f"/v1/jobs/{job_id}/artifacts/native/archive?token=abc.def"), 401)
        assert_problem(c.get(f"/v1/jobs/{job_id}/artifacts/native/archive"), 401)
        # Tokens are not valid for the other routes.
        assert_problem(c.get(f"/v1/jobs/{job_id}?token={token}"), 401)

        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() + settings.link_ttl_s + 5)
        body = assert_problem(c.get(url), 401)
        assert "expired" in body["detail"]
        monkeypatch.setattr(time, "time", real_time)

        with sessions() as s:
            revoke_key(s, key)
        body = assert_problem(c.get(url), 401)
        assert "revoked" in body["detail"]


def test_console_is_served_with_a_strict_policy(client: TestClient) -> None:
    r = client.get("/ui", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/ui/"
    page = client.get("/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp
    html = page.text
    for needle in [
        'for="api-key">API key<',
        ">Sign in<",
        'for="model">Model<',
        'for="target-bits">Target bits<',
        ">Quantize<",
        ">Preview<",
        'id="downloads"',
        ">Cancel<",
    ]:
        assert needle in html, needle
    # Nothing from another origin.
    assert "http://" not in html.replace('xmlns="http://', "") and "https://" not in html.replace(
        "https://example.com", ""
    )
    for asset, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        a = client.get(f"/ui/assets/{asset}")
        assert a.status_code == 200 and kind in a.headers["content-type"], asset
        assert a.headers["content-security-policy"] == csp
    js = client.get("/ui/assets/app.js").text
    assert "sessionStorage" in js and "innerHTML" not in js
    assert client.get("/ui/assets/nope.js").status_code == 404
