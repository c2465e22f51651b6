"""Create, revoke and check API keys. The plaintext key exists only in create_key's result."""

from __future__ import annotations

import hashlib
import secrets
import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import ApiKey
from app.errors import NotFoundError, UnauthorizedError, ValidationFailedError

KEY_PREFIX = "higgs_"
DISPLAY_CHARS = len(KEY_PREFIX) + 6


class KeyNotFoundError(NotFoundError):
    code = "key_not_found"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    # 32 random bytes: guessing is hopeless, so a plain (unsalted) sha256 is a safe store.
    return KEY_PREFIX + secrets.token_urlsafe(32)


def create_key(session: Session, name: str) -> tuple[ApiKey, str]:
    """A new key named `name`; returns the row and the plaintext key (never stored)."""
    name = name.strip()
    if not name or len(name) > 200:
        raise ValidationFailedError.field("name", f"key name {name!r} must be 1..200 characters")
    key = generate_key()
    row = ApiKey(
        id=str(uuid.uuid4()), name=name, prefix=key[:DISPLAY_CHARS], key_hash=hash_key(key)
    )
    session.add(row)
    session.commit()
    return row, key


def find_key(session: Session, key_or_id: str) -> ApiKey:
    """By plaintext key, by id, or by display prefix (when it names exactly one key)."""
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key_or_id)))
    if row is None:
        row = session.get(ApiKey, key_or_id)
    if row is None and key_or_id.startswith(KEY_PREFIX):
        rows = session.scalars(select(ApiKey).where(ApiKey.prefix == key_or_id)).all()
        if len(rows) > 1:
            raise KeyNotFoundError(f"prefix {key_or_id!r} matches {len(rows)} keys; give the id")
        row = rows[0] if rows else None
    if row is None:
        raise KeyNotFoundError(f"no API key matches {key_or_id!r} (give the key, its id or prefix)")
    return row


def revoke_key(session: Session, key_or_id: str) -> ApiKey:
    """Revoke a key (idempotent); requests with it get 401 from then on."""
    row = find_key(session, key_or_id)
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.commit()
    return row


def authenticate(session: Session, authorization: str | None) -> ApiKey:
    """The key named by an `Authorization: Bearer <key>` header, or UnauthorizedError."""
    if not authorization:
        raise UnauthorizedError(
            "missing Authorization header; send 'Authorization: Bearer <api key>'"
        )
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise UnauthorizedError("Authorization header must be 'Bearer <api key>'")
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
    if row is None:
        raise UnauthorizedError("unknown API key")
    if row.revoked_at is not None:
        raise UnauthorizedError(f"API key {row.prefix}... was revoked")
    return row
