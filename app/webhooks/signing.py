"""Signing webhook events: HMAC-SHA256 under the API key's webhook secret.

Every delivery carries

    Higgs-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + raw body)>

A receiver recomputes the HMAC over the raw body bytes it got, compares in constant time, and
refuses timestamps older than a few minutes (replays). `verify` below is that check.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

SIGNATURE_HEADER = "Higgs-Signature"
EVENT_ID_HEADER = "Higgs-Event-Id"
SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE_S = 300


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def signature(secret: str, body: bytes, timestamp: int) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return mac.hexdigest()


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The Higgs-Signature header value for `body`."""
    t = int(time.time()) if timestamp is None else int(timestamp)
    return f"t={t},v1={signature(secret, body, t)}"


def verify(
    secret: str,
    body: bytes,
    header: str,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> bool:
    """True when `header` is a valid signature of `body` made within tolerance_s of `now`."""
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        k, _, v = part.strip().partition("=")
        fields.setdefault(k, []).append(v)
    try:
        t = int(fields["t"][0])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - t) > tolerance_s:
        return False
    expected = signature(secret, body, t)
    return any(hmac.compare_digest(expected, v) for v in fields.get("v1", []))
