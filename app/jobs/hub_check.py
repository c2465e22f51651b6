"""The Hub config check at submit, bounded: a gguf job for a Hub model has its config.json read
(app.jobs.hub_config) to refuse an architecture llama.cpp cannot convert, and that read holds an
API thread until the Hub answers or `timeout_s` passes. So that a tenant sending many such
submits against a slow Hub cannot hold the API's threads, at most `most` reads run at once in
an API process and at most `per_key` of them for one API key. A submit that finds no free slot
is answered at once, never queued: 429 `hub_check_busy` when its own key already has
`per_key` reads running, 503 `hub_check_busy` when the process has `most` running; both with
Retry-After.

Answers (an architecture) are kept for `ttl_s` and failures (no answer in time, a private or
missing repository, bad JSON) for `failure_ttl_s` per (model, revision, token), shared by every
key of the process that reads with the same token (an answer read with one token is never given
to a request with another): a Hub that does not answer costs one timeout per model and
`failure_ttl_s`, not one per submit.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.errors import ServiceUnavailableError, TooManyRequestsError
from app.jobs.hub_config import hub_architecture

__all__ = ["HubCheckBusyError", "HubCheckLimits", "HubChecks", "HubChecksFullError"]

# read(model_id, revision, timeout_s, token) -> the architecture or None
Reader = Callable[[str, str | None, float, str | None], str | None]


class HubCheckBusyError(TooManyRequestsError):
    code, title = "hub_check_busy", "Too many Hub checks for this API key"


class HubChecksFullError(ServiceUnavailableError):
    code, title = "hub_check_busy", "Too many Hub checks"


@dataclass(frozen=True)
class HubCheckLimits:
    """How long one read may take, how many run at once (in all, per key), how long answers
    and failures are kept."""

    timeout_s: float
    most: int
    per_key: int
    ttl_s: float
    failure_ttl_s: float

    @classmethod
    def of(cls, settings: Any) -> HubCheckLimits:
        return cls(
            timeout_s=settings.hub_check_timeout_s,
            most=settings.hub_check_concurrency,
            per_key=settings.hub_check_per_key,
            ttl_s=settings.hub_check_cache_s,
            failure_ttl_s=settings.hub_check_failure_cache_s,
        )


class HubChecks:
    """Bounded, cached Hub architecture reads of one API process (thread-safe)."""

    MAX_ENTRIES = 4096

    def __init__(self, limits: HubCheckLimits, read: Reader = hub_architecture) -> None:
        self.limits = limits
        self._read = read
        # (model, revision, sha256 of the token) -> (expires, arch)
        self._cache: dict[tuple[str, str, str], tuple[float, str | None]] = {}
        self._running: dict[str, int] = {}  # key id -> reads in flight
        self._total = 0
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        with self._lock:
            return self._total

    def _cached(self, entry: tuple[str, str, str]) -> tuple[bool, str | None]:
        with self._lock:
            hit = self._cache.get(entry)
        if hit is not None and hit[0] > time.monotonic():
            return True, hit[1]
        return False, None

    def _take(self, key_id: str) -> None:
        retry = max(1, math.ceil(self.limits.timeout_s))
        with self._lock:
            mine = self._running.get(key_id, 0)
            if mine >= self.limits.per_key:
                raise HubCheckBusyError(
                    f"this API key already has {mine} Hub config checks running, the most "
                    f"allowed (HIGGS_HUB_CHECK_PER_KEY = {self.limits.per_key}); retry in "
                    f"{retry} s",
                    retry_after=retry,
                )
            if self._total >= self.limits.most:
                raise HubChecksFullError(
                    f"{self._total} Hub config checks are running, the most allowed "
                    f"(HIGGS_HUB_CHECK_CONCURRENCY = {self.limits.most}); retry in {retry} s",
                    retry_after=retry,
                )
            self._running[key_id] = mine + 1
            self._total += 1

    def _give(self, key_id: str) -> None:
        with self._lock:
            self._total -= 1
            left = self._running.get(key_id, 1) - 1
            if left > 0:
                self._running[key_id] = left
            else:
                self._running.pop(key_id, None)

    def architecture(
        self,
        key_id: str,
        model_id: str,
        revision: str | None,
        token: Callable[[], str | None] | None = None,
    ) -> str | None:
        """The Hub model's architecture read with `token()` (the job's Hub token, asked only
        here; None: anonymously), cached; None when the Hub did not tell within timeout_s (or
        timeout_s is 0); HubCheckBusyError (429) / HubChecksFullError (503) at once when no
        read slot is free."""
        if self.limits.timeout_s <= 0:
            return None
        secret = token() if token is not None else None
        who = hashlib.sha256(secret.encode()).hexdigest() if secret else ""
        entry = (model_id, revision or "main", who)
        hit, arch = self._cached(entry)
        if hit:
            return arch
        self._take(key_id)
        try:
            arch = self._read(model_id, revision, self.limits.timeout_s, secret)
        finally:
            self._give(key_id)
        ttl = self.limits.ttl_s if arch is not None else self.limits.failure_ttl_s
        with self._lock:
            if len(self._cache) >= self.MAX_ENTRIES:
                now = time.monotonic()
                live = {k: v for k, v in self._cache.items() if v[0] > now}
                self._cache = live if len(live) < self.MAX_ENTRIES else {}
            self._cache[entry] = (time.monotonic() + ttl, arch)
        return arch
