"""A key's own Hugging Face Hub token: stored encrypted, never returned, used for that key's jobs
only (the worker's downloads and the submit-time config check).

The token is encrypted with Fernet (AES-128-CBC + HMAC-SHA256, the `cryptography` package)
under a key derived from the service setting HIGGS_HUB_TOKEN_SECRET (sha256 of it). That
setting may list several secrets, comma-separated: the first encrypts, every one decrypts, so
an operator rotates it by putting the new secret first. Without it no key can store a token.

Which token a job uses (HubTokens.for_key): the key's own when it has one; otherwise the
service's HIGGS_HF_TOKEN only when HIGGS_HF_TOKEN_KEYS names the key (or is "*"); otherwise
none (public repositories only).
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import ApiKey
from app.errors import NotSupportedError, ValidationFailedError
from app.settings import Settings

if TYPE_CHECKING:
    from cryptography.fernet import MultiFernet

__all__ = [
    "HubTokenStatus",
    "HubTokenUnreadableError",
    "HubTokens",
    "clear_hub_token",
    "hub_token_status",
    "set_hub_token",
]

# A Hub token is printable ASCII without spaces ("hf_" + 34 characters today).
_TOKEN = re.compile(r"^[\x21-\x7e]{8,512}$")


class HubTokenUnreadableError(ValueError):
    """The stored token does not decrypt with any secret of HIGGS_HUB_TOKEN_SECRET."""


@dataclass(frozen=True)
class HubTokenStatus:
    set: bool
    set_at: datetime | None


def _secrets(setting: str | None) -> list[str]:
    return [s.strip() for s in (setting or "").split(",") if s.strip()]


def _cipher(setting: str | None) -> MultiFernet | None:
    from cryptography.fernet import Fernet, MultiFernet

    keys = [
        Fernet(base64.urlsafe_b64encode(hashlib.sha256(f"higgs-hub-token:{s}".encode()).digest()))
        for s in _secrets(setting)
    ]
    return MultiFernet(keys) if keys else None


def _check_token(token: str) -> str:
    token = token.strip()
    if not _TOKEN.fullmatch(token):
        # The value is a secret: the message describes it and never repeats it.
        raise ValidationFailedError.field(
            "token",
            f"a Hub token is 8..512 printable ASCII characters without spaces (got "
            f"{len(token)} characters{', with spaces or control characters' if token else ''})",
        )
    return token


def set_hub_token(session: Session, key_id: str, token: str, settings: Settings) -> HubTokenStatus:
    """Store `token` (encrypted) as the key's Hub token, replacing any earlier one."""
    cipher = _cipher(settings.hub_token_secret)
    if cipher is None:
        raise NotSupportedError.field(
            "token",
            "this service stores no per-key Hub tokens: the operator has not set "
            "HIGGS_HUB_TOKEN_SECRET",
        )
    sealed = cipher.encrypt(_check_token(token).encode()).decode()
    now = utcnow()
    session.execute(
        update(ApiKey).where(ApiKey.id == key_id).values(hub_token=sealed, hub_token_set_at=now)
    )
    session.commit()
    return HubTokenStatus(True, now)


def clear_hub_token(session: Session, key_id: str) -> HubTokenStatus:
    session.execute(
        update(ApiKey).where(ApiKey.id == key_id).values(hub_token=None, hub_token_set_at=None)
    )
    session.commit()
    return HubTokenStatus(False, None)


def hub_token_status(session: Session, key_id: str) -> HubTokenStatus:
    row = session.execute(
        select(ApiKey.hub_token, ApiKey.hub_token_set_at).where(ApiKey.id == key_id)
    ).one_or_none()
    if row is None or row[0] is None:
        return HubTokenStatus(False, None)
    return HubTokenStatus(True, row[1])


@dataclass(frozen=True)
class HubTokens:
    """The service's token rules, from the settings (read once per process)."""

    secret: str | None = None
    service_token: str | None = None
    # "*" or the key ids that may use the service token.
    service_keys: frozenset[str] = frozenset()

    @classmethod
    def from_settings(cls, settings: Settings) -> HubTokens:
        return cls(
            secret=settings.hub_token_secret,
            service_token=settings.hf_token or None,
            service_keys=frozenset(_secrets(settings.hf_token_keys)),
        )

    def service_token_for(self, key_id: str) -> str | None:
        if self.service_token and ("*" in self.service_keys or key_id in self.service_keys):
            return self.service_token
        return None

    def for_key(self, session: Session, key_id: str | None) -> str | None:
        """The token a job of `key_id` uses: its own, else the service's where the operator
        allows it, else None. HubTokenUnreadableError when its own does not decrypt."""
        if key_id is None:
            return None
        sealed = session.scalar(select(ApiKey.hub_token).where(ApiKey.id == key_id))
        if sealed is None:
            return self.service_token_for(key_id)
        from cryptography.fernet import InvalidToken

        cipher = _cipher(self.secret)
        try:
            if cipher is None:
                raise InvalidToken
            return cipher.decrypt(sealed.encode()).decode()
        except InvalidToken:
            raise HubTokenUnreadableError(
                "the API key's Hub token cannot be decrypted with HIGGS_HUB_TOKEN_SECRET (the "
                "secret changed?); set the token again with PUT /v1/keys/me/hub-token"
            ) from None
