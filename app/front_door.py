"""What the API decides about a request before any route reads it: who the client is, who the
caller is, and how long its body may take.

- ForwardedForMiddleware: the client address is the TCP peer's, unless that peer is one of the
  configured proxies (HIGGS_FORWARDED_ALLOW_IPS, none by default); then it is the address the
  proxies recorded in X-Forwarded-For (the right-most one that is not itself a trusted proxy).
  uvicorn runs with --no-proxy-headers, so its own default (trust 127.0.0.1) never applies: a
  client cannot pick its address, and with it its bucket of failed authentications, by
  sending the header.
- AuthFirstMiddleware: a request that carries a body to an authenticated route (POST, PUT,
  PATCH under /v1/) has its API key checked, and its rate limit taken, before a byte of the
  body is read: 401 / 429 at once, and the connection closed. Its body must then arrive within
  HIGGS_BODY_TIMEOUT_S of the request's start (408 `body_timeout` otherwise, the connection
  closed): a body trickled a byte at a time holds no connection for longer.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi.security import HTTPAuthorizationCredentials
from fastapi.security.utils import get_authorization_scheme_param
from sqlalchemy import exc as sa_exc
from starlette.requests import Request
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.deps import AUTHENTICATED_KEY, authenticate, bearer_token
from app.errors import PROBLEM_JSON, AppError
from app.proxies import TrustedProxies

__all__ = ["AuthFirstMiddleware", "BodyTimeoutError", "ForwardedForMiddleware"]

BODY_METHODS = ("POST", "PUT", "PATCH")


class BodyTimeoutError(AppError):
    status, code, title = 408, "body_timeout", "Request body timeout"


def _header(scope: Scope, name: bytes) -> str | None:
    values = [v.decode("latin-1") for k, v in scope.get("headers", []) if k == name]
    return ",".join(values) if values else None


class ForwardedForMiddleware:
    """scope["client"] from X-Forwarded-For (and scope["scheme"] from X-Forwarded-Proto) when
    the TCP peer is a trusted proxy; untouched otherwise."""

    def __init__(self, app: ASGIApp, trusted: TrustedProxies) -> None:
        self.app = app
        self.trusted = trusted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        peer = scope.get("client")
        if scope["type"] in ("http", "websocket") and peer and peer[0] in self.trusted:
            chain = _header(scope, b"x-forwarded-for")
            client = self.trusted.client(chain) if chain else None
            if client is not None:
                scope["client"] = (client, 0)
            proto = _header(scope, b"x-forwarded-proto")
            if proto and proto.split(",")[-1].strip() in ("http", "https"):
                scope["scheme"] = proto.split(",")[-1].strip()
        await self.app(scope, receive, send)


def _problem(err: AppError, scope: Scope, close: bool) -> tuple[Message, Message]:
    """The response messages of a problem+json answer (Retry-After / WWW-Authenticate as
    app.main renders them), with Connection: close when the body was not read."""
    body = json.dumps(err.problem(scope.get("path")), separators=(",", ":")).encode()
    headers = [
        (b"content-type", PROBLEM_JSON.encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    retry_after = getattr(err, "retry_after", None)
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    if err.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="higgs"'))
    if close:
        headers.append((b"connection", b"close"))
    return (
        {"type": "http.response.start", "status": err.status, "headers": headers},
        {"type": "http.response.body", "body": body, "more_body": False},
    )


class AuthFirstMiddleware:
    """The API key before the body, then the body within `body_timeout_s` (0: no deadline)."""

    def __init__(self, app: ASGIApp, body_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s

    @staticmethod
    def _authenticated_route(scope: Scope) -> bool:
        """A route under /v1/ answers this method on this path (all of them need a key)."""
        if not scope.get("path", "").startswith("/v1/"):
            return False
        routes: list[Any] = getattr(scope.get("app"), "routes", None) or []
        return any(route.matches(scope)[0] == Match.FULL for route in routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        if self._authenticated_route(scope):
            request = Request(scope)
            scheme, token = get_authorization_scheme_param(_header(scope, b"authorization"))
            credentials = (
                HTTPAuthorizationCredentials(scheme=scheme, credentials=token)
                if scheme.lower() == "bearer" and token
                else None
            )
            try:
                key = await authenticate(request, bearer_token(credentials))
            except AppError as err:
                for message in _problem(err, scope, close=True):
                    await send(message)
                return
            except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError):
                pass  # the database did not answer: the route's own check answers 503
            else:
                setattr(request.state, AUTHENTICATED_KEY, key)
        await self._body_in_time(scope, receive, send)

    async def _body_in_time(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.body_timeout_s <= 0:
            await self.app(scope, receive, send)
            return
        ends = time.monotonic() + self.body_timeout_s
        complete = False
        started = False

        async def timed_receive() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, ends - time.monotonic()))
            except TimeoutError:
                raise BodyTimeoutError(
                    f"the request body did not arrive within {self.body_timeout_s:g} s "
                    "(HIGGS_BODY_TIMEOUT_S)"
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message

        async def closing_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if not complete:  # the rest of the body is not read: no keep-alive
                    message = {
                        **message,
                        "headers": [*message.get("headers", []), (b"connection", b"close")],
                    }
            await send(message)

        try:
            await self.app(scope, timed_receive, closing_send)
        except BodyTimeoutError as err:
            if started:
                return
            for message in _problem(err, scope, close=True):
                await send(message)
