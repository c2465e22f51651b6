"""`higgs keys create/revoke/list` through the real command, then the key against the API."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import select

from app.db.models import ApiKey
from app.db.session import create_db_engine, session_factory
from app.keys.service import hash_key
from app.main import create_app
from app.settings import Settings
from tests.fixtures import assert_problem

ROOT = Path(__file__).resolve().parents[2]


def higgs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HIGGS_")}
    return subprocess.run(
        # What the `higgs` console script runs.
        [
            sys.executable,
            "-c",
            "import sys; from higgs_cli.main import main; sys.exit(main())",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
    )


def test_keys_create_revoke_list(tmp_path: Path) -> None:
    data = tmp_path / "data"
    r = higgs("keys", "create", "ci-bot", "--data-dir", str(data))
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip().splitlines()[-1]
    assert key.startswith("higgs_") and " " not in key and len(key) > 40

    settings = Settings(data_dir=data)
    engine = create_db_engine(settings.database_url)
    with session_factory(engine)() as s:
        rows = s.scalars(select(ApiKey)).all()
        assert [(k.name, k.key_hash) for k in rows] == [("ci-bot", hash_key(key))]
        # Only the hash is stored: the key appears in no column.
        assert all(key not in str(v) for k in rows for v in vars(k).values())
    engine.dispose()

    with TestClient(create_app(settings)) as c:
        assert c.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        # The webhook secret is printed above the key, and the API returns the same one.
        secret = c.get("/v1/webhooks/secret", headers={"Authorization": f"Bearer {key}"})
        assert secret.status_code == 200 and secret.json()["secret"].startswith("whsec_")
        lines = r.stdout.strip().splitlines()
        assert any(secret.json()["secret"] in line for line in lines[:-1]), r.stdout
        listed = higgs("keys", "list", "--data-dir", str(data))
        assert listed.returncode == 0 and "ci-bot" in listed.stdout and key not in listed.stdout
        r = higgs("keys", "revoke", key, "--data-dir", str(data))
        assert r.returncode == 0, r.stderr
        assert "revoked" in r.stdout
        # A revocation takes effect within the key cache's TTL (HIGGS_AUTH_CACHE_TTL_S): the
        # two commands above can finish inside it on a fast machine.
        time.sleep(settings.auth_cache_ttl_s + 0.1)
        assert_problem(c.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}), 401)

    bad = higgs("keys", "revoke", "no-such-key", "--data-dir", str(data))
    assert bad.returncode == 2 and bad.stderr.startswith("higgs: error: no API key matches")
    assert "Traceback" not in bad.stderr
    env_dir = higgs("keys", "create", "from-env", env={"HIGGS_DATA_DIR": str(data)})
    assert env_dir.returncode == 0, env_dir.stderr
