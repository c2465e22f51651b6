"""app.deadline.RequestDeadlineMiddleware on small ASGI apps: a response that has not started
by the deadline is a 503 dependency_timeout with Retry-After; a started response, the time a
slow client takes to send its body and a switched-off deadline are left alone; the late answer
of a timed-out request goes nowhere, without an error."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import anyio.to_thread
import httpx
import pytest
from starlette.types import Receive, Scope, Send

from app import deadline
from app.deadline import RequestDeadlineMiddleware
from tests.fixtures import assert_problem

TIMEOUT_S = 0.5


async def _respond(send: Send, body: bytes = b"ok", status: int = 200) -> None:
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def slow_app(scope: Scope, receive: Receive, send: Send) -> None:
    await asyncio.sleep(3)
    await _respond(send)


async def stuck_thread_then_fails(scope: Scope, receive: Receive, send: Send) -> None:
    """A blocking call in a worker thread (what a frozen database looks like), then a response
    and an error, both after the deadline."""
    await anyio.to_thread.run_sync(time.sleep, 1.0)
    await _respond(send, b"late")
    raise RuntimeError("late failure")


async def streams_slowly(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(4):
        await asyncio.sleep(0.3)
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def reads_body(scope: Scope, receive: Receive, send: Send) -> None:
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    await asyncio.sleep(TIMEOUT_S * 0.6)  # server time, within the deadline
    await _respond(send, str(size).encode())


def _call(app: object, method: str = "GET", content: object = None) -> tuple[httpx.Response, float]:
    async def go() -> tuple[httpx.Response, float]:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            t0 = time.monotonic()
            r = await client.request(method, "/v1/x", content=content)  # type: ignore[arg-type]
            took = time.monotonic() - t0
            # Let a timed-out request's app run to its end inside this event loop.
            for _ in range(50):
                if not deadline._orphans:
                    break
                await asyncio.sleep(0.1)
            assert not deadline._orphans
            return r, took

    return asyncio.run(go())


def test_no_response_by_the_deadline_is_a_503_with_retry_after() -> None:
    r, took = _call(RequestDeadlineMiddleware(slow_app, timeout_s=TIMEOUT_S, retry_after_s=7))
    body = assert_problem(r, 503)
    assert body["code"] == "dependency_timeout" and body["instance"] == "/v1/x"
    assert body["type"].endswith("/dependency-timeout") and body["title"] and body["detail"]
    assert r.headers["retry-after"] == "7"
    assert TIMEOUT_S <= took < TIMEOUT_S + 1


def test_the_late_answer_of_a_stuck_thread_goes_nowhere_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    app = RequestDeadlineMiddleware(stuck_thread_then_fails, timeout_s=TIMEOUT_S, retry_after_s=5)
    r, took = _call(app)
    assert_problem(r, 503)
    assert took < 1.0
    assert not [rec for rec in caplog.records if rec.exc_info]
    assert any("ended later with RuntimeError" in rec.getMessage() for rec in caplog.records)


async def listens_for_disconnect(scope: Scope, receive: Receive, send: Send) -> None:
    """Waits in two receive() calls at once (a disconnect listener besides the body)."""
    listener = asyncio.ensure_future(receive())
    await asyncio.sleep(0.05)
    await reads_body(scope, receive, send)
    listener.cancel()


def test_a_started_response_is_never_cut() -> None:
    app = RequestDeadlineMiddleware(streams_slowly, timeout_s=TIMEOUT_S, retry_after_s=5)
    r, took = _call(app)
    assert r.status_code == 200 and r.content == b"xxxx"
    assert took > TIMEOUT_S


def test_time_receiving_the_body_does_not_count() -> None:
    async def slow_upload() -> AsyncIterator[bytes]:
        for _ in range(4):
            await asyncio.sleep(0.3)
            yield b"abc"

    app = RequestDeadlineMiddleware(reads_body, timeout_s=TIMEOUT_S, retry_after_s=5)
    r, took = _call(app, "POST", slow_upload())
    assert r.status_code == 200 and r.content == b"12"
    assert took > TIMEOUT_S


def test_zero_switches_the_deadline_off() -> None:
    async def app_(scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.sleep(TIMEOUT_S + 0.3)
        await _respond(send)

    r, _ = _call(RequestDeadlineMiddleware(app_, timeout_s=0, retry_after_s=5))
    assert r.status_code == 200


def test_two_receives_at_once() -> None:
    app = RequestDeadlineMiddleware(listens_for_disconnect, timeout_s=TIMEOUT_S, retry_after_s=5)
    r, _ = _call(app, "POST", b"abcd")
    assert r.status_code == 200
