"""A gguf job for a Hub model: its architecture is read from the Hub's config.json at submit
(a local HTTP server stands in for the Hub: HF_ENDPOINT's resolve/<revision>/config.json URL),
an unknown one is a 422 naming options.formats, and a Hub that does not answer in time leaves
the check to the worker (the job is accepted)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from app.errors import ValidationFailedError
from app.jobs import hub_config
from app.jobs.schemas import JobCreate
from app.jobs.service import validate_request
from app.settings import Settings

CONFIGS = {
    "org/llama": {"architectures": ["LlamaForCausalLM"]},
    "org/odd": {"architectures": ["NoSuchModelForCausalLM"]},
}


class _Hub(BaseHTTPRequestHandler):
    seen: ClassVar[list[str]] = []
    auth: ClassVar[list[str | None]] = []
    delay_s = 0.0

    def do_GET(self) -> None:  # http.server's name
        _Hub.seen.append(self.path)
        _Hub.auth.append(self.headers.get("Authorization"))
        parts = self.path.strip("/").split("/")
        repo = "/".join(parts[:2])
        if len(parts) != 5 or parts[2] != "resolve" or parts[4] != "config.json":
            self.send_error(404)
            return
        if repo not in CONFIGS:
            self.send_error(401)  # what the Hub answers for a missing or private repository
            return
        time.sleep(_Hub.delay_s)
        body = json.dumps(CONFIGS[repo]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(hub_config, "_cache", {})
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", "/nonexistent")
    _Hub.seen.clear()
    _Hub.auth.clear()
    _Hub.delay_s = 0.0
    try:
        yield url
    finally:
        srv.shutdown()


def _settings(tmp_path: Path, timeout_s: float) -> Settings:
    return Settings(
        database_url=f"sqlite:///{tmp_path}/db.sqlite",
        data_dir=tmp_path / "data",
        hub_check_timeout_s=timeout_s,
    )


def _gguf(model: str, revision: str | None = None) -> JobCreate:
    ref: dict[str, Any] = {"id": model}
    if revision:
        ref["revision"] = revision
    return JobCreate.model_validate(
        {"model": ref, "target": {"bits": 4}, "options": {"formats": ["gguf"]}}
    )


def test_unknown_hub_architecture_is_a_422_naming_formats(hub: str, tmp_path: Path) -> None:
    with pytest.raises(ValidationFailedError) as e:
        validate_request(_gguf("org/odd"), _settings(tmp_path, 3.0))
    assert (e.value.errors or [{}])[0].get("field") == "options.formats"
    assert "NoSuchModelForCausalLM" in str(e.value)
    assert _Hub.seen == ["/org/odd/resolve/main/config.json"]


def test_known_hub_architecture_passes_and_is_cached(hub: str, tmp_path: Path) -> None:
    s = _settings(tmp_path, 3.0)
    validate_request(_gguf("org/llama", "abc123"), s)
    validate_request(_gguf("org/llama", "abc123"), s)
    assert _Hub.seen == ["/org/llama/resolve/abc123/config.json"]  # asked once


def test_unreadable_or_slow_hub_leaves_the_check_to_the_worker(hub: str, tmp_path: Path) -> None:
    validate_request(_gguf("org/private"), _settings(tmp_path, 3.0))  # 401: accepted
    hub_config._cache.clear()
    _Hub.delay_s = 1.0
    t0 = time.monotonic()
    validate_request(_gguf("org/odd"), _settings(tmp_path, 0.2))  # no answer in time
    assert time.monotonic() - t0 < 1.0
    assert hub_config.hub_architecture("org/odd", None, 0) is None  # 0: never asked


def test_other_formats_never_ask_the_hub(hub: str, tmp_path: Path) -> None:
    req = JobCreate.model_validate({"model": {"id": "org/odd"}, "target": {"bits": 4}})
    validate_request(req, _settings(tmp_path, 3.0))
    assert _Hub.seen == []


def test_only_the_jobs_own_token_is_sent(
    hub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process's HF_TOKEN (or stored login) is never sent: only the token the job will use.
    monkeypatch.setenv("HF_TOKEN", "hf_process_secret")
    s = _settings(tmp_path, 3.0)
    validate_request(_gguf("org/llama"), s)
    validate_request(_gguf("org/llama"), s, None, lambda: "hf_key_secret")
    validate_request(_gguf("org/llama"), s, None, lambda: "hf_key_secret")  # cached
    validate_request(_gguf("org/llama"), s, None, lambda: "hf_other_key")
    # One read per token: an answer read with one key's token is not another's.
    assert _Hub.auth == [None, "Bearer hf_key_secret", "Bearer hf_other_key"]


def test_the_token_is_not_read_when_nothing_asks_the_hub(hub: str, tmp_path: Path) -> None:
    def never() -> str:
        raise AssertionError("the token was read")

    validate_request(_gguf("org/llama"), _settings(tmp_path, 0.0), None, never)
    validate_request(
        JobCreate.model_validate({"model": {"id": "org/llama"}, "target": {"bits": 4}}),
        _settings(tmp_path, 3.0),
        None,
        never,
    )
