"""Calibration uploads (POST /v1/calibrations) and jobs referencing them, over HTTP against
migrated SQLite and PostgreSQL databases."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from app.db.base import utcnow
from app.db.models import Calibration, Job
from app.keys.service import create_key
from app.main import create_app
from app.settings import Settings
from tests.fixtures import assert_problem

TEXT = ("The council met on Monday to discuss the new library budget. " * 400).encode()


def upload(client: TestClient, auth: dict[str, str], body: bytes) -> Any:
    return client.post(
        "/v1/calibrations", content=body, headers={**auth, "Content-Type": "text/plain"}
    )


def job_body(**options: Any) -> dict[str, Any]:
    return {"model": {"id": "tiny"}, "target": {"bits": 4}, "options": options}


def test_upload_get_list_and_submit(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    r = upload(client, auth, TEXT)
    assert r.status_code == 201, r.text
    cal = r.json()
    assert cal["sha256"] == hashlib.sha256(TEXT).hexdigest() and cal["bytes"] == len(TEXT)
    assert r.headers["Location"] == f"/v1/calibrations/{cal['id']}"
    assert client.get(f"/v1/calibrations/{cal['id']}", headers=auth).json() == cal
    assert [c["id"] for c in client.get("/v1/calibrations", headers=auth).json()["data"]] == [
        cal["id"]
    ]
    with sessions() as s:
        row = s.get(Calibration, cal["id"])
        assert row is not None and row.text.encode() == TEXT
    r = client.post(
        "/v1/jobs", json=job_body(calibration=cal["id"], calibration_tokens=512), headers=auth
    )
    assert r.status_code == 202, r.text
    job = r.json()
    want = {"id": cal["id"], "sha256": cal["sha256"], "bytes": len(TEXT), "tokens": 512}
    assert job["config"]["calibration"] == want
    assert job["request"]["options"]["calibration"] == cal["id"]
    with sessions() as s:
        stored = s.scalars(select(Job).where(Job.id == job["id"])).one()
        assert stored.config["calibration"] == want
    # Without calibration_tokens: the engine default, recorded on the job.
    r = client.post("/v1/jobs", json=job_body(calibration=cal["id"]), headers=auth)
    assert r.status_code == 202 and r.json()["config"]["calibration"]["tokens"] == 8192
    # A job without calibration has no entry.
    plain = client.post("/v1/jobs", json=job_body(), headers=auth).json()
    assert "calibration" not in plain["config"]


def test_bad_uploads_are_422_or_413_naming_the_body(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    for body, needle in [
        (b"", "empty"),
        (b"  \n\t", "empty"),
        (b"abc\x00def", "NUL"),
        (b"\xff\xfe\xfd binary", "UTF-8"),
    ]:
        p = assert_problem(upload(client, auth, body), 422, "calibration")
        assert needle in p["detail"], p
    with sessions() as s:
        assert s.scalars(select(Calibration)).all() == []


def test_upload_size_limit_is_its_own(settings: Settings, sessions: sessionmaker[Session]) -> None:
    small = settings.model_copy(update={"calibration_max_bytes": 4096})
    with TestClient(create_app(small)) as client, sessions() as s:
        _, key = create_key(s, "carol")
        auth = {"Authorization": f"Bearer {key}"}
        # Above the general 64 KiB body limit is fine for a calibration upload...
        big = settings.model_copy(update={"calibration_max_bytes": 200_000})
        with TestClient(create_app(big)) as c2:
            assert upload(c2, auth, TEXT[:100_000]).status_code == 201
        # ... and above the calibration limit is 413, whether declared or streamed.
        p = assert_problem(upload(client, auth, TEXT[:5000]), 413)
        assert "4096" in p["detail"]

        def chunks() -> Any:
            for _ in range(10):
                yield b"x" * 1000

        r = client.post(
            "/v1/calibrations", content=chunks(), headers={**auth, "Content-Type": "text/plain"}
        )
        assert_problem(r, 413)
        # Other routes keep the general limit.
        r = client.post("/v1/jobs", content=b"{" + b" " * 70_000 + b"}", headers=auth)
        assert_problem(r, 413)


def test_jobs_refuse_unusable_calibrations(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    short = upload(client, auth, b"only a few words here").json()
    assert_problem(
        client.post("/v1/jobs", json=job_body(calibration="nope"), headers=auth),
        422,
        "options.calibration",
    )
    # Fewer bytes than tokens asked for: certainly too few tokens.
    p = assert_problem(
        client.post(
            "/v1/jobs", json=job_body(calibration=short["id"], calibration_tokens=64), headers=auth
        ),
        422,
        "options.calibration_tokens",
    )
    assert "21 bytes" in p["detail"]
    assert_problem(
        client.post("/v1/jobs", json=job_body(calibration=short["id"]), headers=auth),
        422,
        "options.calibration",
    )
    assert_problem(
        client.post("/v1/jobs", json=job_body(calibration_tokens=64), headers=auth),
        422,
        "options.calibration_tokens",
    )
    assert_problem(
        client.post(
            "/v1/jobs", json=job_body(calibration=short["id"], calibration_tokens=1), headers=auth
        ),
        422,
        "options.calibration_tokens",
    )
    with sessions() as s:
        assert s.scalars(select(Job)).all() == []


def test_other_keys_upload_is_not_found(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    cal = upload(client, auth, TEXT).json()
    with sessions() as s:
        _, other = create_key(s, "bob")
    bob = {"Authorization": f"Bearer {other}"}
    assert_problem(client.get(f"/v1/calibrations/{cal['id']}", headers=bob), 404)
    assert client.get("/v1/calibrations", headers=bob).json()["data"] == []
    assert_problem(
        client.post("/v1/jobs", json=job_body(calibration=cal["id"]), headers=bob),
        422,
        "options.calibration",
    )
    assert_problem(client.post("/v1/calibrations", content=TEXT), 401)


def test_default_tokens_agree_with_the_engine() -> None:
    from app.calibrations.service import DEFAULT_CALIBRATION_TOKENS as APP_DEFAULT
    from higgs_engine.calibration import DEFAULT_CALIBRATION_TOKENS as ENGINE_DEFAULT

    assert APP_DEFAULT == ENGINE_DEFAULT


def test_storage_quota_per_key_is_422_naming_the_limit(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    by_count = settings.model_copy(update={"calibration_max_per_key": 2})
    with TestClient(create_app(by_count)) as client, sessions() as s:
        _, alice = create_key(s, "alice")
        _, bob = create_key(s, "bob")
        a, b = ({"Authorization": f"Bearer {k}"} for k in (alice, bob))
        assert [upload(client, a, TEXT).status_code for _ in range(2)] == [201, 201]
        p = assert_problem(upload(client, a, TEXT), 422)
        assert p["code"] == "calibration_quota_exceeded", p
        assert "HIGGS_CALIBRATION_MAX_PER_KEY = 2" in p["detail"] and "30 days" in p["detail"]
        assert upload(client, b, TEXT).status_code == 201  # another key has its own quota
    by_bytes = settings.model_copy(
        update={"calibration_max_per_key": 0, "calibration_max_total_bytes_per_key": 3 * len(TEXT)}
    )
    with TestClient(create_app(by_bytes)) as client:
        assert upload(client, b, TEXT).status_code == 201  # bob: 2 uploads stored
        p = assert_problem(upload(client, b, TEXT + b"!"), 422)
        assert "HIGGS_CALIBRATION_MAX_TOTAL_BYTES_PER_KEY" in p["detail"], p
        assert upload(client, b, TEXT).status_code == 201  # exactly at the limit
    with sessions() as s:
        assert len(s.scalars(select(Calibration)).all()) == 5


def test_concurrent_uploads_of_one_key_respect_the_quota(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from app.calibrations.service import CalibrationQuotaError, Upload, create
    from app.keys.service import AuthKey

    quota = settings.model_copy(update={"calibration_max_per_key": 3})
    with sessions() as s:
        row, _ = create_key(s, "racer")
        key = AuthKey.of(row)

    def one(_: int) -> bool:
        with sessions() as s:
            try:
                create(s, key, Upload.of(TEXT), quota)
            except CalibrationQuotaError:
                return False
            return True

    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(one, range(12)))
    assert made.count(True) == 3, made
    with sessions() as s:
        assert len(s.scalars(select(Calibration)).all()) == 3


def test_sweep_deletes_old_uploads_no_active_job_uses(
    settings: Settings, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    from app.calibrations.service import Upload, create
    from app.db.models import SUCCEEDED
    from app.keys.service import AuthKey
    from tests.app.factories import make_job
    from worker.sweep import sweep

    with sessions() as s:
        row, _ = create_key(s, "old")
        key = AuthKey.of(row)
        ids = [create(s, key, Upload.of(TEXT), settings).id for _ in range(4)]
        old_unused, old_queued, old_done, fresh = ids
        for cid in (old_unused, old_queued, old_done):
            s.execute(
                update(Calibration)
                .where(Calibration.id == cid)
                .values(created_at=utcnow() - timedelta(days=31))
            )
        s.commit()
        for cid, status in ((old_queued, "queued"), (old_done, SUCCEEDED)):
            job = make_job(s, key.id, status=status)
            job.config = {**job.config, "calibration": {"id": cid}}
            s.commit()
        make_job(s, key.id)  # a queued job without calibration

    out = sweep(sessions, settings, lambda _: True, lambda: 0)
    assert sorted(out.calibrations) == sorted([old_unused, old_done])
    with sessions() as s:
        left = set(s.scalars(select(Calibration.id)))
    assert left == {old_queued, fresh}
    # Retention 0 keeps everything.
    with sessions() as s:
        s.execute(update(Calibration).values(created_at=utcnow() - timedelta(days=3650)))
        s.commit()
    keep = settings.model_copy(update={"calibration_retention_days": 0})
    assert sweep(sessions, keep, lambda _: True, lambda: 0).calibrations == []
