"""Webhooks: URL checks at submit, per-key signing secrets, and the dispatcher delivering
signed events to a real local HTTP receiver (retries after a 500, bounded attempts, nothing
for other tenants' jobs)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.db.models import WebhookDelivery
from app.jobs import state
from app.main import create_app
from app.settings import Settings
from app.webhooks.service import dispatch_once
from app.webhooks.signing import sign, verify
from app.webhooks.urls import WebhookUrlError, check_webhook_url, pin, refused_reason
from tests.app.factories import make_key
from tests.fixtures import assert_problem


@dataclass
class Receiver:
    """A local HTTP server recording POSTs; answers `codes` in turn, then 200."""

    url: str
    codes: list[int] = field(default_factory=list)
    got: list[tuple[dict[str, str], bytes]] = field(default_factory=list)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec = Receiver(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            rec.got.append((dict(self.headers.items()), body))
            code = rec.codes.pop(0) if rec.codes else 200
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rec.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield rec
    server.shutdown()
    server.server_close()


@pytest.fixture
def hook_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"webhook_allow_private": True, "webhook_backoff_s": 0.01, "webhook_timeout_s": 5}
    )


def _submit(c: TestClient, key: str, **extra: Any) -> dict[str, Any]:
    r = c.post(
        "/v1/jobs",
        json={"model": {"id": "tiny"}, "target": {"bits": 4}, **extra},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 202, r.text
    out: dict[str, Any] = r.json()
    return out


def _secret(c: TestClient, key: str) -> str:
    r = c.get("/v1/webhooks/secret", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    assert r.json()["algorithm"] == "HMAC-SHA256"
    return str(r.json()["secret"])


def _succeed(sessions: sessionmaker[Session], job_id: str) -> None:
    with sessions() as s:
        assert state.claim(s, job_id, "w1") is not None
        state.succeed(s, job_id, {"bits_per_weight": 4.25, "layers": []}, worker_id="w1")


# ---------------------------------------------------------------- URL rules


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.0.7", "private"),
        ("172.16.5.4", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("::ffff:127.0.0.1", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("100.64.0.1", "shared"),
        # Special-purpose IPv4 blocks ipaddress calls global (Python 3.11).
        ("192.0.0.8", "IETF protocol assignments"),
        ("192.0.0.170", "IETF protocol assignments"),
        ("192.88.99.1", "6to4 relay anycast"),
        ("198.18.0.1", "benchmarking"),
        ("192.0.2.1", "documentation"),
        ("224.0.0.1", "multicast"),
        ("255.255.255.255", "broadcast"),
        ("240.0.0.1", "reserved"),
        # IPv6 outside global unicast, or special inside it.
        ("fec0::1", "site-local"),
        ("fc00::1", "unique local"),
        ("::", "unspecified"),
        ("::7f00:1", "not global unicast"),  # IPv4-compatible ::127.0.0.1
        ("100::1", "discard-only"),
        ("5f00::1", "not global unicast"),
        ("2001:db8::1", "documentation"),
        ("3fff::1", "documentation"),
        ("ff02::1", "multicast"),
        # Transition forms carry an IPv4 address: it is the one checked.
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("2002:a9fe:a9fe::", "link-local"),  # 6to4 of 169.254.169.254
        ("2002:0a00:0001::1", "private"),  # 6to4 of 10.0.0.1
        ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "private"),  # Teredo client 10.0.0.1
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "documentation"),  # client 192.0.2.45
        ("2001:0:5db8:d822:8000:63bf:a2ff:fe98", "not globally routable"),  # Teredo, public
        ("64:ff9b::7f00:1", "loopback"),  # NAT64 of 127.0.0.1
        ("64:ff9b::a9fe:a9fe", "link-local"),
        ("64:ff9b::c000:8", "IETF protocol assignments"),  # NAT64 of 192.0.0.8
        ("64:ff9b:1:7f00:0:100::", "loopback"),  # local-use NAT64 /48 of 127.0.0.1
        ("64:ff9b:1:5db8:d8:2200::", "local-use NAT64"),  # of a public address
        ("::ffff:10.0.0.1", "private"),
        # Public ones.
        ("93.184.216.34", None),
        ("2606:2800:220:1:248:1893:25c8:1946", None),
        ("2002:5db8:d822::1", None),  # 6to4 of 93.184.216.34
        ("64:ff9b::5db8:d822", None),  # NAT64 of 93.184.216.34
        ("::ffff:93.184.216.34", None),
    ],
)
def test_refused_addresses(address: str, reason: str | None) -> None:
    got = refused_reason(address)
    assert (got is None) == (reason is None), (address, got)
    if reason is not None:
        assert got is not None and reason in got, (address, got)


def test_check_webhook_url_resolves_and_checks_every_address() -> None:
    public = lambda host, port: ["93.184.216.34"]  # noqa: E731
    mixed = lambda host, port: ["93.184.216.34", "10.0.0.5"]  # noqa: E731
    assert check_webhook_url("https://hooks.example/x", allow_private=False, resolver=public)
    with pytest.raises(WebhookUrlError, match=r"'hooks\.example' is not allowed") as refused:
        check_webhook_url("https://hooks.example/x", allow_private=False, resolver=mixed)
    assert "10.0.0.5" not in str(refused.value) and "a private" not in str(refused.value)
    assert check_webhook_url("https://hooks.example/x", allow_private=True, resolver=mixed)
    for bad, why in [
        ("ftp://example.com/x", "http:// or https://"),
        ("example.com/x", "http:// or https://"),
        ("http:///x", "no host"),
        ("https://u:p@example.com/", "user name or password"),
        ("http://example.com:99999/", "not a valid URL"),
    ]:
        with pytest.raises(WebhookUrlError, match=why):
            check_webhook_url(bad, allow_private=True, resolver=public)
    with pytest.raises(WebhookUrlError, match="'localhost' is not allowed"):
        check_webhook_url("http://localhost:8080/hook", allow_private=False)
    # An address written in the URL is judged as it is, and the answer may say why.
    for literal, why in [
        ("http://[2002:7f00:1::]/x", "loopback"),
        ("http://[fec0::1]/x", "site-local"),
        ("http://192.0.0.8/x", "IETF protocol assignments"),
        ("http://[64:ff9b::a9fe:a9fe]/x", "link-local"),
    ]:
        with pytest.raises(WebhookUrlError, match=why):
            check_webhook_url(literal, allow_private=False, resolver=public)


def test_refusals_of_names_do_not_say_what_they_resolve_to() -> None:
    """A name that resolves to an internal address and one that does not resolve at all get the
    same answer: the 422 is no way to map the service's internal DNS."""

    def fails(host: str, port: int) -> list[str]:
        raise OSError("Name or service not known")

    answers = set()
    for resolver in [
        lambda host, port: ["10.20.30.40"],
        lambda host, port: ["2002:a9fe:a9fe::"],
        lambda host, port: ["fd00::1234"],
        lambda host, port: [],
        fails,
    ]:
        with pytest.raises(WebhookUrlError) as info:
            check_webhook_url("https://db.internal/x", allow_private=False, resolver=resolver)
        answers.add(str(info.value))
    (answer,) = answers
    assert "'db.internal' is not allowed" in answer
    for leak in ("10.20.30.40", "a9fe", "fd00", "a private", "link-local", "resolve"):
        assert leak not in answer, answer


def test_submit_refuses_private_webhook_urls_with_422(
    client: TestClient, auth: dict[str, str]
) -> None:
    for url in [
        "http://127.0.0.1:9/hook",
        "http://169.254.169.254/latest",
        "http://[::1]/x",
        "http://[2002:7f00:1::]/hook",
        "http://[2002:a9fe:a9fe::]/latest",
        "http://[fec0::1]/x",
        "http://192.0.0.8/x",
        "http://[64:ff9b::7f00:1]/x",
        "gopher://x",
    ]:
        r = client.post(
            "/v1/jobs",
            json={"model": {"id": "tiny"}, "target": {"bits": 4}, "webhook_url": url},
            headers=auth,
        )
        body = assert_problem(r, 422, "webhook_url")
        assert (
            url.split("/")[2].strip("[]").split(":")[0] in body["detail"]
            or "http" in body["detail"]
        )
    assert client.get("/v1/jobs", headers=auth).json()["data"] == []  # nothing was stored


def test_submit_with_allowed_webhook_url_is_shown(
    hook_settings: Settings, sessions: sessionmaker[Session]
) -> None:
    with sessions() as s:
        _, key = make_key(s, "a")
    with TestClient(create_app(hook_settings)) as c:
        job = _submit(c, key, webhook_url="http://127.0.0.1:9/hook")
        assert job["webhook_url"] == "http://127.0.0.1:9/hook"
        assert job["request"]["webhook_url"] == "http://127.0.0.1:9/hook"
        plain = _submit(c, key)
        assert plain["webhook_url"] is None and "webhook_url" not in plain["request"]


# ---------------------------------------------------------------- secrets


def test_secret_per_key_stable_and_rotatable(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    with sessions() as s:
        _, a = make_key(s, "a")
        _, b = make_key(s, "b")
    sa, sb = _secret(client, a), _secret(client, b)
    assert sa.startswith("whsec_") and sa != sb
    assert _secret(client, a) == sa
    r = client.post("/v1/webhooks/secret/rotate", headers={"Authorization": f"Bearer {a}"})
    assert r.status_code == 200 and r.json()["secret"] not in (sa, sb)
    assert _secret(client, a) == r.json()["secret"]
    assert_problem(client.get("/v1/webhooks/secret"), 401)


def test_sign_and_verify() -> None:
    body = b'{"a":1}'
    header = sign("whsec_x", body, timestamp=1_700_000_000)
    assert verify("whsec_x", body, header, now=1_700_000_010)
    assert not verify("whsec_y", body, header, now=1_700_000_010)
    assert not verify("whsec_x", body + b" ", header, now=1_700_000_010)
    assert not verify("whsec_x", body, header, now=1_700_000_000 + 3600)  # replayed late
    assert not verify("whsec_x", body, "garbage", now=1_700_000_000)


def test_the_signature_covers_the_timestamp_and_the_body_id_not_the_headers() -> None:
    """What receivers de-duplicate by (docs/api.md): the signed body's id. The Higgs-Event-Id
    header is an unsigned copy; changing the body's id or the timestamp breaks the signature."""
    body = json.dumps({"id": "evt-1", "type": "job.succeeded"}, separators=(",", ":")).encode()
    header = sign("whsec_x", body, timestamp=1_700_000_000)
    assert verify("whsec_x", body, header, now=1_700_000_001)
    forged = body.replace(b"evt-1", b"evt-2")
    assert not verify("whsec_x", forged, header, now=1_700_000_001)
    shifted = header.replace("t=1700000000", "t=1700000300")
    assert not verify("whsec_x", body, shifted, now=1_700_000_301)


# ---------------------------------------------------------------- delivery


def test_delivery_signed_retried_after_500_and_listed(
    hook_settings: Settings, sessions: sessionmaker[Session], receiver: Receiver
) -> None:
    with sessions() as s:
        _, a = make_key(s, "alice")
        _, b = make_key(s, "bob")
    receiver.codes = [500]
    with TestClient(create_app(hook_settings)) as c:
        job = _submit(c, a, webhook_url=receiver.url)
        other = _submit(c, b)  # bob's job: no webhook, nothing may reach alice's receiver
        assert dispatch_once(sessions, hook_settings)["made"] == 0  # not terminal yet
        _succeed(sessions, job["id"])
        _succeed(sessions, other["id"])

        first = dispatch_once(sessions, hook_settings)
        assert first["made"] == 1 and first["pending"] == 1, first
        assert len(receiver.got) == 1
        deliveries = c.get(
            f"/v1/jobs/{job['id']}/webhooks", headers={"Authorization": f"Bearer {a}"}
        )
        assert deliveries.status_code == 200
        (d,) = deliveries.json()["data"]
        assert d["state"] == "pending" and d["attempts"] == 1 and d["last_status_code"] == 500

        import time

        time.sleep(0.05)  # past the (tiny) backoff
        second = dispatch_once(sessions, hook_settings)
        assert second["delivered"] == 1, second
        assert len(receiver.got) == 2
        assert dispatch_once(sessions, hook_settings)["sent"] == 0  # delivered: never again

        secret_a, secret_b = _secret(c, a), _secret(c, b)
        for headers, body in receiver.got:
            assert verify(secret_a, body, headers["Higgs-Signature"])
            assert not verify(secret_b, body, headers["Higgs-Signature"])
            event = json.loads(body)
            assert event["job_id"] == job["id"] and event["status"] == "succeeded"
            assert event["type"] == "job.succeeded" and event["summary"]["bits_per_weight"] == 4.25
            assert event["finished_at"] and event["created_at"]
            assert headers["Higgs-Event-Id"] == event["id"]
        assert [h["Higgs-Delivery-Attempt"] for h, _ in receiver.got] == ["1", "2"]

        d = c.get(f"/v1/jobs/{job['id']}/webhooks", headers={"Authorization": f"Bearer {a}"}).json()
        (row,) = d["data"]
        assert row["state"] == "delivered" and row["attempts"] == 2 and row["delivered_at"]
        assert [e["status_code"] for e in row["attempt_log"]] == [500, 200]
        # Another tenant cannot see alice's deliveries; bob's own job has none.
        assert_problem(
            c.get(f"/v1/jobs/{job['id']}/webhooks", headers={"Authorization": f"Bearer {b}"}), 404
        )
        mine = c.get(f"/v1/jobs/{other['id']}/webhooks", headers={"Authorization": f"Bearer {b}"})
        assert mine.json() == {"job_id": other["id"], "webhook_url": None, "data": []}
    with sessions() as s:
        assert s.query(WebhookDelivery).count() == 1


def test_cancelled_and_failed_jobs_get_events_too(
    hook_settings: Settings, sessions: sessionmaker[Session], receiver: Receiver
) -> None:
    with sessions() as s:
        _, a = make_key(s, "alice")
    with TestClient(create_app(hook_settings)) as c:
        queued = _submit(c, a, webhook_url=receiver.url)
        running = _submit(c, a, webhook_url=receiver.url)
        assert (
            c.post(
                f"/v1/jobs/{queued['id']}/cancel", headers={"Authorization": f"Bearer {a}"}
            ).status_code
            == 200
        )
        with sessions() as s:
            state.claim(s, running["id"], "w1")
            state.fail(s, running["id"], "invalid_model", "no such model", worker_id="w1")
        out = dispatch_once(sessions, hook_settings)
        assert out["delivered"] == 2, out
    events = {json.loads(b)["job_id"]: json.loads(b) for _, b in receiver.got}
    assert events[queued["id"]]["status"] == "cancelled"
    assert events[running["id"]]["status"] == "failed"
    assert events[running["id"]]["error"] == {"code": "invalid_model", "message": "no such model"}


def test_retries_are_bounded(
    hook_settings: Settings, sessions: sessionmaker[Session], receiver: Receiver
) -> None:
    settings = hook_settings.model_copy(
        update={"webhook_max_attempts": 3, "webhook_backoff_s": 0.001}
    )
    with sessions() as s:
        _, a = make_key(s, "alice")
    receiver.codes = [500] * 10
    with TestClient(create_app(settings)) as c:
        job = _submit(c, a, webhook_url=receiver.url)
        _succeed(sessions, job["id"])
        import time

        for _ in range(6):
            dispatch_once(sessions, settings)
            time.sleep(0.01)
        (row,) = c.get(
            f"/v1/jobs/{job['id']}/webhooks", headers={"Authorization": f"Bearer {a}"}
        ).json()["data"]
    assert row["state"] == "failed" and row["attempts"] == 3 and len(receiver.got) == 3
    assert row["next_attempt_at"] is None and row["last_status_code"] == 500


def test_unreachable_receiver_is_an_outcome_not_a_crash(
    hook_settings: Settings, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with sessions() as s:
        _, a = make_key(s, "alice")
    with TestClient(create_app(hook_settings)) as c:
        job = _submit(c, a, webhook_url=f"http://127.0.0.1:{port}/hook")
        _succeed(sessions, job["id"])
        out = dispatch_once(sessions, hook_settings)
        assert out["pending"] == 1
        (row,) = c.get(
            f"/v1/jobs/{job['id']}/webhooks", headers={"Authorization": f"Bearer {a}"}
        ).json()["data"]
    assert row["last_status_code"] is None and "ConnectError" in row["last_error"]


def test_slow_receiver_times_out_and_is_retried_later(
    hook_settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """A receiver slower than HIGGS_WEBHOOK_TIMEOUT_S costs the dispatcher that timeout, is
    recorded as a failed try and retried; the job finished before any of it."""
    import time

    release = threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's name
            release.wait(10)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings = hook_settings.model_copy(update={"webhook_timeout_s": 0.5})
    try:
        with sessions() as s:
            _, a = make_key(s, "alice")
        with TestClient(create_app(settings)) as c:
            url = f"http://127.0.0.1:{server.server_address[1]}/hook"
            job = _submit(c, a, webhook_url=url)
            _succeed(sessions, job["id"])
            assert (
                c.get(f"/v1/jobs/{job['id']}", headers={"Authorization": f"Bearer {a}"}).json()[
                    "status"
                ]
                == "succeeded"
            )
            t0 = time.monotonic()
            out = dispatch_once(sessions, settings)
            assert time.monotonic() - t0 < 5
            assert out["pending"] == 1, out
            (row,) = c.get(
                f"/v1/jobs/{job['id']}/webhooks", headers={"Authorization": f"Bearer {a}"}
            ).json()["data"]
        assert row["state"] == "pending" and "Timeout" in row["last_error"]
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_deliveries_connect_to_the_checked_address() -> None:
    p = pin("https://hooks.example:8443/a/b?x=1", "93.184.216.34")
    assert p.url == "https://93.184.216.34:8443/a/b?x=1"
    assert p.headers == {"Host": "hooks.example:8443"}
    assert p.extensions == {"sni_hostname": "hooks.example"}  # TLS still checks the name
    p6 = pin("http://hooks.example", "2606:2800:220:1::1")
    assert p6.url == "http://[2606:2800:220:1::1]/" and p6.extensions == {}
    assert p6.headers == {"Host": "hooks.example"}


def test_pinned_delivery_reaches_the_checked_address_with_the_original_host(
    settings: Settings,
    sessions: sessionmaker[Session],
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without HIGGS_WEBHOOK_ALLOW_PRIVATE the POST goes to the resolved, checked address and
    names the URL's host in the Host header. (Loopback stands in for a public address here.)"""
    import app.webhooks.urls as urls

    port = receiver.url.split(":")[2].split("/")[0]
    monkeypatch.setattr(urls, "resolve_host", lambda host, p: ["127.0.0.1"])
    monkeypatch.setattr(urls, "refused_reason", lambda address: None)
    strict = settings.model_copy(update={"webhook_allow_private": False})
    with sessions() as s:
        _, a = make_key(s, "alice")
    with TestClient(create_app(strict)) as c:
        job = _submit(c, a, webhook_url=f"http://hooks.test:{port}/hook")
        _succeed(sessions, job["id"])
        assert dispatch_once(sessions, strict)["delivered"] == 1
    ((headers, _body),) = receiver.got
    assert headers["Host"] == f"hooks.test:{port}"


# ---------------------------------------------------------------- bounds


class RawReceiver:
    """A TCP server on loopback that runs `answer(conn, stop)` for each connection in a thread
    (after reading the request head): receivers that misbehave at the socket level."""

    def __init__(self, answer: Any) -> None:
        import socket

        self.stop = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.answer = answer
        self.connections = 0
        self.open_now = 0
        self.most_open = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Any) -> None:
        with self._lock:
            self.connections += 1
            self.open_now += 1
            self.most_open = max(self.most_open, self.open_now)
        try:
            conn.settimeout(5)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            self.answer(conn, self.stop)
        except OSError:
            pass
        finally:
            conn.close()
            with self._lock:
                self.open_now -= 1

    def close(self) -> None:
        self.stop.set()
        self._thread.join(5)
        self.sock.close()


def _trickle_headers(conn: Any, stop: threading.Event) -> None:
    """A status line, then one header byte every 0.3 s: no read ever waits long."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    for _ in range(200):  # at most a minute
        if stop.wait(0.3):
            return
        conn.sendall(b"a")


def test_a_trickling_receiver_is_cut_at_the_total_deadline(
    hook_settings: Settings, sessions: sessionmaker[Session]
) -> None:
    import time

    settings = hook_settings.model_copy(update={"webhook_timeout_s": 1.5})
    rec = RawReceiver(_trickle_headers)
    try:
        with sessions() as s:
            _, a = make_key(s, "alice")
        with TestClient(create_app(settings)) as c:
            job = _submit(c, a, webhook_url=rec.url)
            _succeed(sessions, job["id"])
            t0 = time.monotonic()
            out = dispatch_once(sessions, settings)
            took = time.monotonic() - t0
            (row,) = c.get(
                f"/v1/jobs/{job['id']}/webhooks", headers={"Authorization": f"Bearer {a}"}
            ).json()["data"]
    finally:
        rec.close()
    assert took < 6, f"the delivery took {took:.1f} s; its deadline is 1.5 s"
    assert out["pending"] == 1 and rec.connections == 1, out
    assert row["state"] == "pending" and "Timeout" in row["last_error"], row
    assert 1.4 <= row["attempt_log"][0]["duration_ms"] / 1e3 < 6, row


def _endless_answer(sent: list[int]) -> Any:
    def answer(conn: Any, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")
        for _ in range(2000):  # 1 KiB every 20 ms, at most 40 s
            if stop.wait(0.02):
                return
            conn.sendall(b"x" * 1024)  # raises once the client has hung up
            sent[0] += 1024

    return answer


def test_only_the_start_of_a_long_answer_is_read(
    hook_settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """A 2xx with an endless body is a delivery: a few KiB of the answer are read, then the
    connection is dropped (the body is never read whole)."""
    import time

    sent = [0]
    rec = RawReceiver(_endless_answer(sent))
    settings = hook_settings.model_copy(update={"webhook_timeout_s": 20})
    try:
        with sessions() as s:
            _, a = make_key(s, "alice")
        with TestClient(create_app(settings)) as c:
            job = _submit(c, a, webhook_url=rec.url)
            _succeed(sessions, job["id"])
            t0 = time.monotonic()
            out = dispatch_once(sessions, settings)
            took = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while rec.open_now and time.monotonic() < deadline:  # the receiver sees the hang-up
            time.sleep(0.05)
    finally:
        rec.close()
    assert out["delivered"] == 1, out
    assert took < 8, f"reading the answer took {took:.1f} s"
    assert rec.open_now == 0 and sent[0] < 1_000_000, sent


def test_a_slow_tenant_does_not_delay_another_tenants_delivery(
    hook_settings: Settings, sessions: sessionmaker[Session], receiver: Receiver
) -> None:
    """Alice's receiver holds every request until its deadline; her deliveries take at most
    HIGGS_WEBHOOK_PER_KEY_CONCURRENCY slots, and bob's event, due while hers hang, is delivered
    at once by the next tick instead of after her deadline."""
    import time

    from app.webhooks.service import Dispatcher

    settings = hook_settings.model_copy(
        update={"webhook_timeout_s": 8, "webhook_concurrency": 3, "webhook_per_key_concurrency": 2}
    )

    def hang(conn: Any, stop: threading.Event) -> None:
        stop.wait(15)

    slow = RawReceiver(hang)
    got_at: list[float] = []
    dispatcher = Dispatcher(sessions, settings)
    try:
        with sessions() as s:
            _, a = make_key(s, "alice")
            _, b = make_key(s, "bob")
        with TestClient(create_app(settings)) as c:
            alice_jobs = [_submit(c, a, webhook_url=slow.url)["id"] for _ in range(4)]
            bob_job = _submit(c, b, webhook_url=receiver.url)["id"]
            for job_id in alice_jobs:
                _succeed(sessions, job_id)
            assert dispatcher.tick() == {"made": 4, "sent": 2}
            deadline = time.monotonic() + 5
            while slow.open_now < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert dispatcher.in_flight() == {dispatcher_key(sessions, alice_jobs[0]): 2}

            _succeed(sessions, bob_job)
            t0 = time.monotonic()
            assert dispatcher.tick() == {"made": 1, "sent": 1}
            while not receiver.got and time.monotonic() < t0 + 10:
                time.sleep(0.01)
            got_at.append(time.monotonic() - t0)
            assert dispatcher.tick()["sent"] == 0  # alice's other two wait for her slots
    finally:
        slow.close()  # alice's receiver lets go: her tries end now
        dispatcher.wait_idle(20)
        dispatcher.close(wait=True)
    assert receiver.got and got_at[0] < 4, f"bob's event arrived after {got_at[0]:.1f} s"
    assert slow.most_open == 2, slow.most_open
    assert dispatcher.recorded["delivered"] == 1 and dispatcher.recorded["pending"] == 2


def dispatcher_key(sessions: sessionmaker[Session], job_id: str) -> str:
    from app.db.models import Job

    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job.api_key_id


def test_redirects_are_not_followed(
    hook_settings: Settings, sessions: sessionmaker[Session], receiver: Receiver
) -> None:
    def redirect(conn: Any, stop: threading.Event) -> None:
        conn.sendall(
            f"HTTP/1.1 307 Temporary Redirect\r\nLocation: {receiver.url}\r\n"
            "Content-Length: 0\r\n\r\n".encode()
        )

    rec = RawReceiver(redirect)
    try:
        with sessions() as s:
            _, a = make_key(s, "alice")
        with TestClient(create_app(hook_settings)) as c:
            job = _submit(c, a, webhook_url=rec.url)
            _succeed(sessions, job["id"])
            assert dispatch_once(sessions, hook_settings)["pending"] == 1
            (row,) = c.get(
                f"/v1/jobs/{job['id']}/webhooks", headers={"Authorization": f"Bearer {a}"}
            ).json()["data"]
    finally:
        rec.close()
    assert row["last_status_code"] == 307 and row["last_error"] == "HTTP 307", row
    assert receiver.got == []  # the Location was never asked
