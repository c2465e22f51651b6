"""A deadline on every HTTP request until its response starts.

A PostgreSQL server that is frozen as a whole (every backend stopped, a paused container) holds
a query on an already open connection forever: libpq has no client-side query timeout, the
server cannot fire its statement_timeout, and the kernel still acknowledges every packet so TCP
keepalives never fail. RequestDeadlineMiddleware answers such a request 503
`dependency_timeout` with Retry-After once `timeout_s` has passed without the app starting its
response, and drops whatever the app sends for that request afterwards. A response that has
started (an event stream, a download) is never cut.

Time the request spends waiting for its own body from the client (a slow upload) does not count:
the deadline measures the server, not the client's link.

The worker thread that is stuck in the driver cannot be killed (Python has no way to stop a
thread): the request keeps running in the background and its thread stays busy until the
database answers or the connection breaks. Each such request holds one token of anyio's thread
limiter (HIGGS_THREADPOOL_SIZE, anyio's default 40) and one database connection; once all
tokens are held, every request that needs a thread waits for one, and is answered 503 at its
deadline too, instead of hanging unnoticed. Requests that need no thread (/healthz) are
unaffected.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import anyio.to_thread
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import PROBLEM_JSON, ServiceUnavailableError

log = logging.getLogger(__name__)

# Requests answered 503 whose app is still running: kept referenced until they end.
_orphans: set[asyncio.Task[None]] = set()


class DependencyTimeoutError(ServiceUnavailableError):
    code, title = "dependency_timeout", "Request timed out"


def _finished_late(task: asyncio.Task[None]) -> None:
    """The app of a request already answered 503 has ended: whatever it raised is noted in one
    line (its answer went nowhere), never as a traceback."""
    _orphans.discard(task)
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.info("a request answered 503 at its deadline ended later with %s", type(exc).__name__)


class RequestDeadlineMiddleware:
    """503 problem+json with Retry-After for a request whose response has not started within
    `timeout_s` seconds of server time; 0 switches the deadline off."""

    def __init__(
        self,
        app: ASGIApp,
        timeout_s: float,
        retry_after_s: int,
        warn: Any = None,
    ) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        # warn(message): how a passed deadline is logged (app.main's OutageLog: one line per
        # few seconds however many requests time out).
        self.warn = warn or log.warning

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.timeout_s <= 0:
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = loop.create_future()
        late = False
        t0 = time.monotonic()
        # Time spent waiting for the client (its body), which the deadline does not count. The
        # app may wait in more than one receive() at once (a disconnect listener).
        waiting_since: float | None = None
        waiting = 0
        waited = 0.0

        async def timed_receive() -> Message:
            nonlocal waiting_since, waiting, waited
            if waiting == 0:
                waiting_since = time.monotonic()
            waiting += 1
            try:
                return await receive()
            finally:
                waiting -= 1
                if waiting == 0 and waiting_since is not None:
                    waited += time.monotonic() - waiting_since
                    waiting_since = None

        async def guarded_send(message: Message) -> None:
            if late:
                return  # the client already has its 503
            if message["type"] == "http.response.start" and not started.done():
                started.set_result(None)
            await send(message)

        task = asyncio.ensure_future(self.app(scope, timed_receive, guarded_send))
        try:
            while True:
                now = time.monotonic()
                used = now - t0 - waited - (now - waiting_since if waiting_since else 0.0)
                left = self.timeout_s - used
                if left <= 0 and waiting_since is None:
                    break
                await asyncio.wait(
                    {task, started}, timeout=max(left, 0.05), return_when=asyncio.FIRST_COMPLETED
                )
                if task.done() or started.done():
                    await task  # the response (or the app's error) is the app's own
                    return
        except BaseException:
            # This request is cancelled (the server shuts down): so is its app.
            task.cancel()
            raise
        late = True
        _orphans.add(task)
        task.add_done_callback(_finished_late)
        threads = anyio.to_thread.current_default_thread_limiter()
        self.warn(
            f"no response within the {self.timeout_s:g} s request deadline on "
            f"{scope['method']} {scope.get('path', '')}: answering 503 dependency_timeout "
            f"({threads.borrowed_tokens} of {threads.total_tokens:g} threads busy)"
        )
        err = DependencyTimeoutError(
            f"the request was not answered within {self.timeout_s:g} s (a dependency did not "
            "answer); retry later",
            retry_after=self.retry_after_s,
        )
        body = _json(err.problem(scope.get("path")))
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [
                    (b"content-type", PROBLEM_JSON.encode()),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(err.retry_after).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
