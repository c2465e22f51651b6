"""Signed links: short-lived URLs that a plain `<a href>` (which cannot send an Authorization
header) can use for one job's artifact archive, so the long-lived API key never goes into a URL
or an access log.

A token is `<payload>.<mac>`, both base64url: payload = JSON {k: key id, j: job id, f: format,
e: expiry (unix s)}, mac = HMAC-SHA256 under a key derived from the API key's stored hash and
the optional HIGGS_LINK_SECRET. Revoking the key revokes its links.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from dataclasses import dataclass

from sqlalchemy.orm import Session

from app.db.models import ApiKey
from app.errors import UnauthorizedError
from app.params import has_control_char

_DOMAIN = b"higgs-link-v1"
# make_token's tokens are about 200 characters; anything much longer is not one.
MAX_TOKEN_CHARS = 1024


@dataclass(frozen=True)
class LinkClaims:
    key_id: str
    job_id: str
    format: str
    expires: int


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(key: ApiKey, server_secret: str | None, payload: bytes) -> bytes:
    derived = hashlib.sha256(
        _DOMAIN + b"\0" + key.key_hash.encode() + b"\0" + (server_secret or "").encode()
    ).digest()
    return hmac.new(derived, payload, hashlib.sha256).digest()


def make_token(
    session: Session, key_id: str, job_id: str, fmt: str, ttl_s: float, server_secret: str | None
) -> tuple[str, int]:
    """(token, expiry unix seconds) for the key's job_id/fmt archive."""
    key = session.get(ApiKey, key_id)
    if key is None or key.revoked_at is not None:
        raise UnauthorizedError(f"API key {key_id} is unknown or revoked")
    expires = int(time.time() + ttl_s)
    payload = json.dumps(
        {"k": key.id, "j": job_id, "f": fmt, "e": expires}, separators=(",", ":")
    ).encode()
    return f"{_b64(payload)}.{_b64(_mac(key, server_secret, payload))}", expires


def _claims(claims: object) -> LinkClaims:
    """The claims of a decoded payload exactly as make_token writes them; ValueError else."""
    if not isinstance(claims, dict):
        raise ValueError("the payload is not an object")
    k, j, f, e = claims["k"], claims["j"], claims["f"], claims["e"]
    if not all(isinstance(v, str) and v and not has_control_char(v) for v in (k, j, f)):
        raise ValueError("k, j and f must be ids")
    if not isinstance(e, int) or isinstance(e, bool):
        raise ValueError("e must be an integer")
    return LinkClaims(k, j, f, e)


def check_token(
    session: Session, token: str, job_id: str, fmt: str, server_secret: str | None
) -> ApiKey:
    """The API key a valid, unexpired token for job_id/fmt was made with; UnauthorizedError."""
    try:
        payload_b64, mac_b64 = token.split(".", 1)
        payload = _unb64(payload_b64)
        mac = _unb64(mac_b64)
        c = _claims(json.loads(payload))
    except (ValueError, KeyError, TypeError, binascii.Error, RecursionError) as e:
        raise UnauthorizedError("token is not a link token of this service") from e
    key = session.get(ApiKey, c.key_id)
    if key is None or not hmac.compare_digest(mac, _mac(key, server_secret, payload)):
        raise UnauthorizedError("token is not a link token of this service")
    if key.revoked_at is not None:
        raise UnauthorizedError(f"the API key {key.prefix}... of this link was revoked")
    if c.expires < time.time():
        raise UnauthorizedError("the link has expired; ask for a new one")
    if (c.job_id, c.format) != (job_id, fmt):
        raise UnauthorizedError(
            f"the link is for job {c.job_id} format {c.format}, not job {job_id} format {fmt}"
        )
    return key
