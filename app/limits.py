"""Per-key request limits: token buckets for the request rate, slots for open event streams,
and a bucket per client address for failed authentications.

Request rate: each key may make `rate` requests per second on average with bursts of `burst`;
beyond that the request is answered 429 with Retry-After. With a Redis broker the buckets live
in Redis (SharedRateLimiter: one Lua script per request, so every API process draws from the
same bucket); otherwise (the embedded shape: one API process) in the process (RateLimiter).
While Redis does not answer, each process falls back to its own buckets.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from typing import Any

from app.errors import TooManyRequestsError

log = logging.getLogger(__name__)


def _limited(rate: float, burst: int, tokens: float) -> TooManyRequestsError:
    wait = math.ceil((1.0 - tokens) / rate)
    return TooManyRequestsError(
        f"rate limit of {rate:g} requests/s (bursts of {burst}) per API key exceeded; "
        f"retry in {wait} s",
        retry_after=wait,
    )


class RateLimiter:
    """Token buckets by key id, in this process; rate <= 0 switches limiting off."""

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        self.max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens, at)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def take(self, key_id: str) -> float | None:
        """Take one token for key_id: None when taken, else the tokens left (below 1)."""
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.get(key_id, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate)
            if len(self._buckets) >= self.max_keys and key_id not in self._buckets:
                self._buckets.clear()
            if tokens >= 1.0:
                self._buckets[key_id] = (tokens - 1.0, now)
                return None
            self._buckets[key_id] = (tokens, now)
        return tokens

    def empty(self, key_id: str) -> int | None:
        """Seconds until key_id's bucket has a token again (taking none); None when it has."""
        if not self.enabled:
            return None
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.get(key_id, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        return None if tokens >= 1.0 else max(1, math.ceil((1.0 - tokens) / self.rate))

    def check(self, key_id: str) -> None:
        """Take one token for key_id or raise TooManyRequestsError (429, Retry-After)."""
        if not self.enabled:
            return
        left = self.take(key_id)
        if left is not None:
            raise _limited(self.rate, self.burst, left)

    async def acheck(self, key_id: str) -> None:
        self.check(key_id)


# KEYS[1] = the bucket; ARGV = rate, burst. The server's clock, so every process agrees.
# Returns {1, tokens} when a token was taken, {0, tokens} when not (tokens as a string: Lua
# numbers are truncated to integers on the way back).
_BUCKET_LUA = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local v = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(v[1]) or burst
local at = tonumber(v[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local ok = 0
if tokens >= 1 then
  tokens = tokens - 1
  ok = 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return {ok, tostring(tokens)}
"""


class SharedRateLimiter(RateLimiter):
    """The same buckets in Redis, shared by every API process on it. When Redis fails, this
    process's own buckets answer for `backoff_s` before Redis is tried again."""

    PREFIX = "higgs:ratelimit:"

    def __init__(
        self,
        url: str,
        rate: float,
        burst: int,
        *,
        timeout_s: float = 1.0,
        backoff_s: float = 5.0,
    ) -> None:
        super().__init__(rate, burst)
        self.url = url
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self._down_until = 0.0
        self._clients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def _script(self) -> Any:
        """The script bound to a client of the running event loop (an async Redis client
        belongs to the loop it was made on; tests run several)."""
        import asyncio

        import redis.asyncio as aredis

        loop = asyncio.get_running_loop()
        script = self._clients.get(loop)
        if script is None:
            client = aredis.Redis.from_url(
                self.url,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
            )
            script = client.register_script(_BUCKET_LUA)
            self._clients[loop] = script
        return script

    async def acheck(self, key_id: str) -> None:
        if not self.enabled:
            return
        if time.monotonic() >= self._down_until:
            try:
                ok, tokens = await self._script()(
                    keys=[self.PREFIX + key_id], args=[repr(self.rate), self.burst]
                )
            except Exception as exc:  # Redis down or slow: fall back to this process
                self._down_until = time.monotonic() + self.backoff_s
                log.warning(
                    "rate limit: Redis did not answer (%s); this process's own buckets "
                    "answer for %g s",
                    type(exc).__name__,
                    self.backoff_s,
                )
            else:
                if int(ok) != 1:
                    raise _limited(self.rate, self.burst, float(tokens))
                return
        self.check(key_id)


def rate_limiter(settings: Any) -> RateLimiter:
    """Shared through Redis with a Redis broker, else this process's own."""
    if settings.broker_url.startswith(("redis://", "rediss://")):
        return SharedRateLimiter(
            settings.broker_url,
            settings.rate_limit_per_s,
            settings.rate_limit_burst,
            timeout_s=min(1.0, settings.broker_timeout_s),
        )
    return RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst)


class StreamSlots:
    """Open event streams per key in this process: at most `most` at once (0 = no cap)."""

    RETRY_AFTER_S = 5

    def __init__(self, most: int) -> None:
        self.most = most
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def open(self, key_id: str) -> StreamSlot:
        """A slot for one more stream of key_id, or TooManyRequestsError (429)."""
        with self._lock:
            n = self._open.get(key_id, 0)
            if self.most > 0 and n >= self.most:
                raise TooManyRequestsError(
                    f"this API key already has {n} event streams open, the most allowed "
                    f"(HIGGS_MAX_EVENT_STREAMS_PER_KEY = {self.most}); close one or poll "
                    "GET /v1/jobs/{id}",
                    retry_after=self.RETRY_AFTER_S,
                )
            self._open[key_id] = n + 1
        return StreamSlot(self, key_id)

    def count(self, key_id: str) -> int:
        with self._lock:
            return self._open.get(key_id, 0)

    def _close(self, key_id: str) -> None:
        with self._lock:
            n = self._open.get(key_id, 0) - 1
            if n > 0:
                self._open[key_id] = n
            else:
                self._open.pop(key_id, None)


class StreamSlot:
    """One open stream; close() is idempotent (called when the stream ends, and by a
    finaliser of the stream's generator in case it never started)."""

    def __init__(self, slots: StreamSlots, key_id: str) -> None:
        self._slots = slots
        self._key_id = key_id
        self._closed = False
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._slots._close(self._key_id)
