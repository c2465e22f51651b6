"""Webhooks from a real worker process: its dispatcher thread delivers a signed event to a
receiver on loopback while another tenant's receiver holds every request it gets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from app.webhooks.signing import verify
from tests.e2e.test_service_e2e import poll, start_separate, terminal
from tests.fixtures import TINY_MODEL as MODEL

pytestmark = pytest.mark.slow


class Hold:
    """Accepts connections and never answers until released; counts them."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.open_now = self.most_open = self.connections = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.release.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: Any) -> None:
        with self._lock:
            self.connections += 1
            self.open_now += 1
            self.most_open = max(self.most_open, self.open_now)
        self.release.wait(120)
        conn.close()
        with self._lock:
            self.open_now -= 1


@pytest.fixture
def receivers() -> Iterator[tuple[Hold, str, list[tuple[float, dict[str, str], bytes]]]]:
    got: list[tuple[float, dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            got.append((time.monotonic(), dict(self.headers.items()), body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    fast = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=fast.serve_forever, daemon=True).start()
    hold = Hold()
    try:
        yield hold, f"http://127.0.0.1:{fast.server_address[1]}/hook", got
    finally:
        hold.release.set()
        fast.shutdown()
        fast.server_close()
        hold.sock.close()


def test_a_slow_tenants_receiver_does_not_hold_up_another_tenants_event(
    stack_factory: Any, receivers: tuple[Hold, str, list[tuple[float, dict[str, str], bytes]]]
) -> None:
    hold, fast_url, got = receivers
    stack = stack_factory("local")
    stack.env.update(
        {
            "HIGGS_WEBHOOK_ALLOW_PRIVATE": "1",
            "HIGGS_WEBHOOK_TIMEOUT_S": "15",
            "HIGGS_WEBHOOK_PER_KEY_CONCURRENCY": "1",
            "HIGGS_WEBHOOK_BACKOFF_S": "60",
        }
    )
    start_separate(stack)
    alice, bob = stack.create_key("alice"), stack.create_key("bob")
    body = {"model": {"id": MODEL}, "target": {"bits": 4}}
    with stack.client(alice) as a, stack.client(bob) as b:
        slow_jobs = []
        for _ in range(2):
            r = a.post("/v1/jobs", json={**body, "webhook_url": hold.url})
            assert r.status_code == 202, r.text
            slow_jobs.append(r.json()["id"])
        for job_id in slow_jobs:
            assert poll(a, job_id, terminal, stack=stack)["status"] == "succeeded"
        r = b.post("/v1/jobs", json={**body, "webhook_url": fast_url})
        assert r.status_code == 202, r.text
        bob_job = r.json()["id"]
        assert poll(b, bob_job, terminal, stack=stack)["status"] == "succeeded"
        seen = time.monotonic()
        while not got and time.monotonic() < seen + 30:
            time.sleep(0.05)
        assert got, f"bob's event never arrived\n{stack.logs()}"
        # Alice's receiver holds her first delivery for 15 s and her second waits for her one
        # slot; bob's comes with the dispatcher's next ticks, not after hers.
        assert got[0][0] - seen < 8, f"bob's event came {got[0][0] - seen:.1f} s after his job"
        assert hold.most_open == 1, hold.most_open
        secret = b.get("/v1/webhooks/secret").json()["secret"]
        (_, headers, raw), *_ = got
        assert verify(secret, raw, headers["Higgs-Signature"])
        assert b'"job_id":"' + bob_job.encode() + b'"' in raw
