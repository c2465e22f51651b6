"""Per-key Hub tokens with real processes: the embedded `higgs serve` (API + worker) against a
fake Hub on loopback (HF_ENDPOINT). A key's own token is stored encrypted, never echoed, and
sent only for that key's jobs (the worker's downloads and the submit-time config check); a key
without one reads the Hub anonymously, whatever the service's token or the process's HF_TOKEN,
and does not get a private model that another key's job left in the shared cache; the service
token is used only where the operator allows it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.servers import wait_finished
from tests.fake_hub import FakeHub, Repo
from tests.fixtures import TINY_MODEL, assert_problem

pytestmark = pytest.mark.slow

KEY_TOKEN = "hf_keyAtoken0123456789"
SERVICE_TOKEN = "hf_serviceToken0123456789"
PROCESS_TOKEN = "hf_processEnvToken0123456789"
TERMINAL = ("succeeded", "failed", "cancelled")


def _submit(c: httpx.Client, model: str, **options: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": {"id": model}, "target": {"bits": 4}}
    if options:
        body["options"] = options
    return c.post("/v1/jobs", json=body)


def test_a_keys_hub_token_is_used_for_its_jobs_only(
    stack_factory: Any, e2e_models_dir: Path, tmp_path: Path
) -> None:
    odd = tmp_path / "odd"
    shutil.copytree(e2e_models_dir / TINY_MODEL, odd)
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "architectures": ["NoSuchForCausalLM"]}))
    hub = FakeHub(
        {
            "acme/private-tiny": Repo(e2e_models_dir / TINY_MODEL, KEY_TOKEN),
            "acme/private-odd": Repo(odd, KEY_TOKEN),
            "acme/service-tiny": Repo(e2e_models_dir / TINY_MODEL, SERVICE_TOKEN),
        }
    ).start()
    try:
        stack = stack_factory("local")
        stack.env.update(
            {
                "HF_ENDPOINT": hub.url,
                "HF_HUB_OFFLINE": "0",
                "HF_HUB_DISABLE_XET": "1",
                "HF_TOKEN": PROCESS_TOKEN,  # never sent: not the job's token
                "HIGGS_HF_TOKEN": SERVICE_TOKEN,  # the service's, allowed for no key yet
                "HIGGS_HUB_TOKEN_SECRET": "a long random secret for the tests",
                "HIGGS_MAX_ATTEMPTS": "1",
            }
        )
        serve = stack.start_serve()
        key_a = stack.create_key("a", data_dir=stack.data_dir)
        key_b = stack.create_key("b", data_dir=stack.data_dir)
        with stack.client(key_a) as a, stack.client(key_b) as b:
            # Set, never echoed; a bad value is refused without being repeated.
            bad = assert_problem(
                a.put("/v1/keys/me/hub-token", json={"token": "hf bad"}), 422, "token"
            )
            assert "hf bad" not in json.dumps(bad)
            r = a.put("/v1/keys/me/hub-token", json={"token": KEY_TOKEN})
            assert r.status_code == 200 and r.json()["set"] is True, r.text
            assert KEY_TOKEN not in r.text
            assert a.get("/v1/keys/me/hub-token").json()["set"] is True
            assert b.get("/v1/keys/me/hub-token").json() == {
                "set": False,
                "set_at": None,
                "uses": a.get("/v1/keys/me/hub-token").json()["uses"],
            }

            # Key A's job reads the private repository with key A's token.
            job = wait_finished(a, _submit(a, "acme/private-tiny").json()["id"])
            assert job["status"] == "succeeded", job
            assert f"Bearer {KEY_TOKEN}" in hub.auths("acme/private-tiny")
            assert KEY_TOKEN not in json.dumps(job)
            # Key B's job sends no token and gets nothing, although the files are cached.
            job = wait_finished(b, _submit(b, "acme/private-tiny").json()["id"])
            assert (job["status"], job["error"]["code"]) == ("failed", "model_not_found"), job

            # The submit check of a gguf job reads config.json with the job's token: key A
            # sees the unknown architecture (422), key B cannot read it (left to the worker).
            assert_problem(_submit(a, "acme/private-odd", formats=["gguf"]), 422, "options.formats")
            r = _submit(b, "acme/private-odd", formats=["gguf"])
            assert r.status_code == 202, r.text
            assert wait_finished(b, r.json()["id"])["error"]["code"] == "model_not_found"
            config_reads = [
                s.auth for s in hub.seen if s.path.endswith("/private-odd/resolve/main/config.json")
            ]
            assert f"Bearer {KEY_TOKEN}" in config_reads and None in config_reads

            # The service token is allowed for no key: key B cannot use it.
            job = wait_finished(b, _submit(b, "acme/service-tiny").json()["id"])
            assert job["error"]["code"] == "model_not_found", job

            # Cleared: key A reads anonymously again.
            r = a.delete("/v1/keys/me/hub-token")
            assert r.status_code == 200 and r.json()["set"] is False
            job = wait_finished(a, _submit(a, "acme/private-tiny", seed=1).json()["id"])
            assert job["error"]["code"] == "model_not_found", job

        every = {s.auth for s in hub.seen}
        assert every <= {None, f"Bearer {KEY_TOKEN}"}, every  # never the service's or HF_TOKEN
        assert KEY_TOKEN not in serve.log.read_text(errors="replace")
        serve.stop()

        # The operator allows the service token for every key: key B's job uses it.
        stack.env["HIGGS_HF_TOKEN_KEYS"] = "*"
        stack.start_serve()
        with stack.client(key_b) as b:
            job = wait_finished(b, _submit(b, "acme/service-tiny", seed=2).json()["id"])
            assert job["status"] == "succeeded", job
        assert f"Bearer {SERVICE_TOKEN}" in hub.auths("acme/service-tiny")
        assert PROCESS_TOKEN not in {s.auth for s in hub.seen}
    finally:
        hub.close()
