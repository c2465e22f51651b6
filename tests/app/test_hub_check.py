"""A gguf job for a Hub model: its architecture is read from the Hub's config.json at submit
(a local HTTP server stands in for the Hub: HF_ENDPOINT's resolve/<revision>/config.json URL),
an unknown one is a 422 naming options.formats, and a Hub that does not answer in time leaves
the check to the worker (the job is accepted). The reads are bounded (app.jobs.hub_check): at
most so many at once, per key and in all, answered 429 / 503 at once beyond; answers and
failures cached."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from app.errors import ServiceUnavailableError, TooManyRequestsError, ValidationFailedError
from app.jobs import hub_config
from app.jobs.hub_check import HubCheckLimits, HubChecks
from app.jobs.schemas import JobCreate
from app.jobs.service import JobSpec
from app.jobs.service import validate_request as _validate
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
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", "/nonexistent")
    _Hub.seen.clear()
    _Hub.auth.clear()
    _Hub.delay_s = 0.0
    try:
        yield url
    finally:
        srv.shutdown()


def _checks(timeout_s: float, most: int = 4, per_key: int = 1) -> HubChecks:
    return HubChecks(HubCheckLimits(timeout_s, most, per_key, ttl_s=3600, failure_ttl_s=60))


def validate_request(
    req: JobCreate,
    settings: Settings,
    checks: HubChecks | None = None,
    token: Callable[[], str | None] | None = None,
) -> JobSpec:
    """The API's validation with a bounded Hub check of `settings`' timeout, as one key whose
    jobs read the Hub with `token()`."""
    hub = checks or _checks(settings.hub_check_timeout_s)
    return _validate(req, settings, None, lambda m, r: hub.architecture("key", m, r, token))


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
    checks = _checks(3.0)
    validate_request(_gguf("org/llama", "abc123"), s, checks)
    validate_request(_gguf("org/llama", "abc123"), s, checks)
    assert _Hub.seen == ["/org/llama/resolve/abc123/config.json"]  # asked once


def test_unreadable_or_slow_hub_leaves_the_check_to_the_worker(hub: str, tmp_path: Path) -> None:
    validate_request(_gguf("org/private"), _settings(tmp_path, 3.0))  # 401: accepted
    _Hub.delay_s = 1.0
    t0 = time.monotonic()
    checks = _checks(0.2)
    validate_request(_gguf("org/odd"), _settings(tmp_path, 0.2), checks)  # no answer in time
    assert time.monotonic() - t0 < 1.0
    # The failure is kept: the next submit of that model does not wait for the Hub again.
    asked = len(_Hub.seen)
    validate_request(_gguf("org/odd"), _settings(tmp_path, 0.2), checks)
    assert len(_Hub.seen) == asked
    assert hub_config.hub_architecture("org/odd", None, 0) is None  # 0: never asked
    assert _checks(0).architecture("key", "org/odd", None) is None


def test_hub_checks_are_bounded_per_key_and_in_all(hub: str) -> None:
    """While reads hang, a key past its share is answered 429 and the process past its cap
    503, both at once and with Retry-After; the slots come back when the reads end."""
    _Hub.delay_s = 1.5
    checks = _checks(1.0, most=2, per_key=1)
    with ThreadPoolExecutor(2) as pool:
        hanging = [pool.submit(checks.architecture, k, "org/llama", f"slow{k}") for k in "ab"]
        deadline = time.monotonic() + 5
        while checks.running < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(TooManyRequestsError) as busy:
            checks.architecture("a", "org/another", None)
        assert busy.value.code == "hub_check_busy" and busy.value.retry_after >= 1
        with pytest.raises(ServiceUnavailableError) as full:
            checks.architecture("c", "org/another", None)
        assert full.value.code == "hub_check_busy" and full.value.retry_after >= 1
        assert time.monotonic() - t0 < 0.5  # answered, not queued
        assert [f.result() for f in hanging] == [None, None]
    assert checks.running == 0
    _Hub.delay_s = 0.0
    assert checks.architecture("a", "org/llama", None) == "LlamaForCausalLM"


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
    checks = _checks(3.0)
    validate_request(_gguf("org/llama"), s, checks)
    validate_request(_gguf("org/llama"), s, checks, lambda: "hf_key_secret")
    validate_request(_gguf("org/llama"), s, checks, lambda: "hf_key_secret")  # cached
    validate_request(_gguf("org/llama"), s, checks, lambda: "hf_other_key")
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
