"""Per-key request rate limits: a token bucket per API key, in this API process.

Each key may make `rate` requests per second on average with bursts of `burst`; beyond that
the request is answered 429 with Retry-After. With several API processes each keeps its own
buckets (the limit a key sees is at most processes x rate).
"""

from __future__ import annotations

import math
import threading
import time

from app.errors import TooManyRequestsError


class RateLimiter:
    """Token buckets by key id; rate <= 0 switches limiting off."""

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        self.max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens, at)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def check(self, key_id: str) -> None:
        """Take one token for key_id or raise TooManyRequestsError (429, Retry-After)."""
        if not self.enabled:
            return
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.get(key_id, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate)
            if tokens >= 1.0:
                if len(self._buckets) >= self.max_keys and key_id not in self._buckets:
                    self._buckets.clear()
                self._buckets[key_id] = (tokens - 1.0, now)
                return
            self._buckets[key_id] = (tokens, now)
        wait = math.ceil((1.0 - tokens) / self.rate)
        raise TooManyRequestsError(
            f"rate limit of {self.rate:g} requests/s (bursts of {self.burst}) per API key "
            f"exceeded; retry in {wait} s",
            retry_after=wait,
        )
