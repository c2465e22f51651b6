"""FastAPI dependencies, injected through Annotated aliases (SettingsDep, SessionsDep, ReadsDep,
CurrentKey).

No dependency holds a database session: a route opens one short session for its own work and
closes it before its response is sent, so no connection is ever held across a threadpool hop,
a response body or a stream.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from app.db.session import Reads
from app.errors import TooManyRequestsError, UnauthorizedError
from app.keys.service import AuthKey, KeyCache
from app.limits import RateLimiter
from app.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="an API key from `higgs keys create NAME`")


# The getters are `async def` although they do no I/O: FastAPI runs a plain `def` dependency
# in the threadpool, one thread hop per dependency and request.
async def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_sessions(request: Request) -> sessionmaker[Session]:
    sessions: sessionmaker[Session] = request.app.state.sessions
    return sessions


async def get_reads(request: Request) -> Reads:
    reads: Reads = request.app.state.reads
    return reads


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
ReadsDep = Annotated[Reads, Depends(get_reads)]


def bearer_token(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None or not credentials.credentials.strip():
        raise UnauthorizedError(
            "missing or non-Bearer Authorization header; send 'Authorization: Bearer <api key>'"
        )
    return credentials.credentials.strip()


# Where app.front_door.AuthFirstMiddleware leaves the key it authenticated before the body
# (request.state), so that the route's dependency neither looks it up nor counts it twice.
AUTHENTICATED_KEY = "authenticated_key"


async def current_key(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> AuthKey:
    """The caller's key (cached, see KeyCache), after its rate limit (429 when exceeded)."""
    early: AuthKey | None = getattr(request.state, AUTHENTICATED_KEY, None)
    if early is not None:
        return early
    return await authenticate(request, bearer_token(credentials))


async def authenticate(request: Request, token: str) -> AuthKey:
    """The key of `token` (401 unknown or revoked; 429 past the client address's failed
    authentications or the key's rate limit), remembered on request.state."""
    cache: KeyCache = request.app.state.key_cache
    key = cache.cached(token)
    if key is None:
        key = await load_key(request, cache, token)
    limiter: RateLimiter = request.app.state.rate_limiter
    await limiter.acheck(key.id)
    request.state.api_token = token
    return key


async def load_key(request: Request, cache: KeyCache, token: str) -> AuthKey:
    """A key not in the cache, looked up in the database unless the client's address has used
    up its failed authentications (429 then, without a lookup: random keys cost nothing)."""
    failures: RateLimiter = request.app.state.auth_failures
    address = request.client.host if request.client else "-"
    wait = failures.empty(address)
    if wait is not None:
        raise TooManyRequestsError(
            f"too many failed authentications from this address (HIGGS_AUTH_FAILURES_PER_S = "
            f"{failures.rate:g}/s, bursts of {failures.burst}); retry in {wait} s",
            retry_after=wait,
        )
    try:
        return await run_in_threadpool(cache.load, token)
    except UnauthorizedError:
        if failures.enabled:
            failures.take(address)
        raise


CurrentKey = Annotated[AuthKey, Depends(current_key)]
