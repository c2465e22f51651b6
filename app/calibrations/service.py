"""Calibration text uploads: checked and stored per API key; jobs reference them by id.

The API has no tokenizer (it never loads a model), so at submit time it refuses what is
certainly unusable: an id unknown to this key, or more calibration tokens asked for than the
text has bytes (every token of a byte-level tokenizer covers at least one byte). The worker
tokenizes the text with the model's tokenizer before quantizing anything, and a text with too
few tokens fails the job there, before the first layer.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import Calibration
from app.errors import NotFoundError, PayloadTooLargeError, ValidationFailedError
from app.keys.service import AuthKey

FIELD = "calibration"  # the request body
# The engine's default (higgs_engine.calibration.DEFAULT_CALIBRATION_TOKENS; the app does not
# import that torch-side module, a test checks the two agree).
DEFAULT_CALIBRATION_TOKENS = 8192


def check_text(body: bytes) -> str:
    """The upload as text; 422 naming the body when it is not UTF-8, binary (NUL) or empty."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationFailedError.field(
            FIELD, f"not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from exc
    if "\x00" in text:
        raise ValidationFailedError.field(FIELD, "not a text file (it contains NUL bytes)")
    if not text.strip():
        raise ValidationFailedError.field(FIELD, "the calibration text is empty")
    return text


class CalibrationNotFound(NotFoundError):
    code = "calibration_not_found"


def create(session: Session, key: AuthKey, body: bytes, max_bytes: int) -> Calibration:
    """Check `body` (413 above max_bytes; 422 naming the body when empty, binary or not UTF-8)
    and store it for `key`."""
    if len(body) > max_bytes:
        raise PayloadTooLargeError(
            f"{FIELD}: {len(body)} bytes is above the limit of {max_bytes} bytes"
        )
    text = check_text(body)
    row = Calibration(
        id=str(uuid.uuid4()),
        api_key_id=key.id,
        sha256=hashlib.sha256(body).hexdigest(),
        bytes=len(body),
        text=text,
        created_at=utcnow(),
    )
    session.add(row)
    session.commit()
    return row


def get(session: Session, key: AuthKey, calibration_id: str) -> Calibration:
    row = session.get(Calibration, calibration_id)
    if row is None or row.api_key_id != key.id:  # another key's upload does not exist for you
        raise CalibrationNotFound(f"calibration {calibration_id!r} not found")
    return row


def list_for(session: Session, key: AuthKey, limit: int = 100) -> list[Calibration]:
    q = (
        select(Calibration)
        .where(Calibration.api_key_id == key.id)
        .order_by(Calibration.created_at.desc(), Calibration.id)
        .limit(limit)
    )
    return list(session.scalars(q))


def view(row: Calibration) -> dict[str, Any]:
    return {
        "id": row.id,
        "sha256": row.sha256,
        "bytes": row.bytes,
        "created_at": row.created_at.isoformat(),
    }


def job_calibration(
    session: Session, key: AuthKey, calibration_id: str, tokens: int | None
) -> dict[str, Any]:
    """The job config's `calibration` entry for options.calibration / calibration_tokens;
    422 naming the option when the id is not this key's or the text is certainly too short."""
    row = session.get(Calibration, calibration_id)
    if row is None or row.api_key_id != key.id:
        raise ValidationFailedError.field(
            "options.calibration",
            f"no calibration {calibration_id!r} was uploaded with this API key "
            "(POST /v1/calibrations)",
        )
    want = DEFAULT_CALIBRATION_TOKENS if tokens is None else tokens
    if want > row.bytes:
        raise ValidationFailedError.field(
            "options.calibration_tokens" if tokens is not None else "options.calibration",
            f"the calibration text has {row.bytes} bytes, so fewer than the {want} tokens "
            "requested; upload more text or ask for fewer tokens",
        )
    return {"id": row.id, "sha256": row.sha256, "bytes": row.bytes, "tokens": want}
