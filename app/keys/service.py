"""Create, revoke and check API keys. The plaintext key exists only in create_key's result."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from app.db.base import utcnow
from app.db.models import ApiKey
from app.errors import NotFoundError, UnauthorizedError, ValidationFailedError
from app.webhooks.signing import new_secret

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
        id=str(uuid.uuid4()),
        name=name,
        prefix=key[:DISPLAY_CHARS],
        key_hash=hash_key(key),
        webhook_secret=new_secret(),
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


@dataclass(frozen=True)
class AuthKey:
    """The caller's key as a request sees it: plain values, no database session behind it."""

    id: str
    name: str
    prefix: str

    @classmethod
    def of(cls, row: ApiKey) -> AuthKey:
        return cls(id=row.id, name=row.name, prefix=row.prefix)


class KeyCache:
    """API keys checked against a small in-process cache.

    An entry (a valid key, or the reason a key is refused) lives `ttl_s` seconds, so a
    revocation takes effect within ttl_s everywhere while a busy client costs no database
    round trip per request. Misses are looked up in one short transaction of their own (the
    connection goes back to the pool before the request goes on); concurrent misses of one
    key wait for a single lookup (a lock per key digest, striped over `LOAD_LOCKS`), so an
    expiring entry under load costs one query, not one per request in flight. At most
    `max_entries` entries: when full, the expired ones go, then everything (garbage keys
    cannot grow it).
    """

    LOAD_LOCKS = 64

    def __init__(
        self, sessions: sessionmaker[Session], ttl_s: float, max_entries: int = 10_000
    ) -> None:
        self.sessions = sessions
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, AuthKey | str]] = {}
        self._lock = threading.Lock()
        self._load_locks = [threading.Lock() for _ in range(self.LOAD_LOCKS)]

    def cached(self, key: str) -> AuthKey | None:
        """The key from the cache (UnauthorizedError for a cached refusal); None on a miss."""
        return self._fresh(hash_key(key))

    def _fresh(self, digest: str) -> AuthKey | None:
        with self._lock:
            hit = self._entries.get(digest)
        if hit is None or hit[0] <= time.monotonic():
            return None
        if isinstance(hit[1], str):
            raise UnauthorizedError(hit[1])
        return hit[1]

    def load(self, key: str) -> AuthKey:
        """Look the key up in the database (one short transaction) and cache the answer; a
        lookup of the same key that finished while this one waited for it is used instead."""
        digest = hash_key(key)
        with self._load_locks[int(digest[:8], 16) % self.LOAD_LOCKS]:
            return self._fresh(digest) or self._load(digest)

    def _load(self, digest: str) -> AuthKey:
        with self.sessions() as session:
            row = session.scalar(select(ApiKey).where(ApiKey.key_hash == digest))
            result: AuthKey | str
            if row is None:
                result = "unknown API key"
            elif row.revoked_at is not None:
                result = f"API key {row.prefix}... was revoked"
            else:
                result = AuthKey.of(row)
        now = time.monotonic()
        with self._lock:
            if len(self._entries) >= self.max_entries:
                live = {k: v for k, v in self._entries.items() if v[0] > now}
                self._entries = live if len(live) < self.max_entries else {}
            self._entries[digest] = (now + self.ttl_s, result)
        if isinstance(result, str):
            raise UnauthorizedError(result)
        return result

    def check(self, key: str) -> AuthKey:
        """cached() or load(): the blocking form, for code already off the event loop."""
        return self.cached(key) or self.load(key)


def lock_key(session: Session, key_id: str) -> None:
    """Serialise the check-then-insert of one key's quotas: on PostgreSQL, lock the key's row
    (SELECT ... FOR UPDATE) until the transaction ends; on SQLite, take the database's write
    lock now (a no-op write), so that a concurrent writer's count cannot be stale."""
    if session.get_bind().dialect.name == "sqlite":
        # A column no foreign key points at: the write changes nothing and checks nothing.
        session.execute(update(ApiKey).where(ApiKey.id == key_id).values(name=ApiKey.name))
    else:
        session.execute(select(ApiKey.id).where(ApiKey.id == key_id).with_for_update())
