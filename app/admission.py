"""Fair queueing in front of the routes: an API process works on at most `most` requests at
once (HIGGS_API_CONCURRENCY); the others wait on the event loop, in arrival order per API key
and round robin over keys (the client address stands in for a request without a key).

Without it every request in flight competes at once: for the threadpool, the database
connections and the GIL, which hand themselves out in no particular order, so under a crowd
most requests are quick and some wait for seconds (the embedded default with 200 pollers: a
p99 of seconds beside a p50 of a few hundred ms), and a tenant with many requests in flight
takes the process from a tenant with few. With it, a request waits its turn in a queue whose
order is known, and one key's crowd delays another key by one request per round.

A request holds its place only while the app works on it: not while it waits for its body
from the client (its place is given back and taken again), and not once its response has
started (an event stream or a download streams without one). /healthz, /readyz and /metrics
never wait. Time spent waiting counts towards the request deadline (app.deadline): a request
that cannot be served within it is answered 503 there.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["FairAdmission", "FairAdmissionMiddleware"]

EXEMPT = ("/healthz", "/readyz", "/metrics")


class FairAdmission:
    """At most `most` holders; waiters served round robin over their `who`, in arrival order
    within one. Event-loop only (no locks): every call runs on the loop."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.active = 0
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def acquire(self, who: str) -> None:
        if self.active < self.most and not self._waiting:
            self.active += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(who, deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the place was handed over as this request was cancelled
            else:
                queue = self._waiting.get(who)
                if queue is not None and fut in queue:
                    queue.remove(fut)
                    if not queue:
                        del self._waiting[who]
            raise

    def release(self) -> None:
        """Hand the place to the next waiter (the next key in turn), or free it."""
        while self._waiting:
            who, queue = next(iter(self._waiting.items()))
            fut = queue.popleft()
            if queue:
                self._waiting.move_to_end(who)  # this key's next request waits a round
            else:
                del self._waiting[who]
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1


def _who(scope: Scope) -> str:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            return "key:" + bytes(value).decode("latin-1")
    client = scope.get("client")
    return "addr:" + str(client[0] if client else "-")


class FairAdmissionMiddleware:
    """FairAdmission around the app for every HTTP request but the probes; most <= 0: off."""

    def __init__(self, app: ASGIApp, most: int) -> None:
        self.app = app
        self.admission = FairAdmission(most)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.admission.most <= 0 or scope.get("path", "") in EXEMPT:
            await self.app(scope, receive, send)
            return
        admission = self.admission
        who = _who(scope)
        holding = False
        started = False

        async def take() -> None:
            nonlocal holding
            if holding:
                return
            await admission.acquire(who)
            holding = True
            if started:  # the response started while this waited for its turn
                give()

        def give() -> None:
            nonlocal holding
            if holding:
                holding = False
                admission.release()

        async def polite_receive() -> Message:
            # No place is held while the client is the one to wait for.
            if started or not holding:
                return await receive()
            give()
            try:
                return await receive()
            finally:
                if not started:
                    await take()

        async def releasing_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                give()  # the rest of the response streams without a place
            await send(message)

        await take()
        try:
            await self.app(scope, polite_receive, releasing_send)
        finally:
            give()
