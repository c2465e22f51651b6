"""Calibration text uploads: checked and stored per API key; jobs reference them by id.

The API has no tokenizer (it never loads a model), so at submit time it refuses what is
certainly unusable: an id unknown to this key, or more calibration tokens asked for than the
text has bytes (every token of a byte-level tokenizer covers at least one byte). The worker
tokenizes the text with the model's tokenizer before quantizing anything, and a text with too
few tokens fails the job there, before the first layer.
"""

from __future__ import annotations

import hashlib
import io
import logging
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session
from starlette.requests import ClientDisconnect

from app.db.base import utcnow
from app.db.models import QUEUED, RUNNING, Calibration, Job
from app.errors import AppError, NotFoundError, PayloadTooLargeError, ValidationFailedError
from app.keys.service import AuthKey, lock_key
from app.settings import Settings

log = logging.getLogger(__name__)

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


class UploadAbortedError(AppError):
    """The client left before its upload was complete (its answer goes nowhere)."""

    status, code, title = 400, "upload_aborted", "Upload aborted"


class CalibrationQuotaError(AppError):
    status, code, title = 422, "calibration_quota_exceeded", "Calibration storage quota exceeded"


@dataclass
class Upload:
    """An upload's bytes as received: spooled (memory up to SPOOL_MEMORY_BYTES, then a
    temporary file), with their size and sha256 computed on the way."""

    file: IO[bytes]
    size: int
    sha256: str

    @classmethod
    def of(cls, body: bytes) -> Upload:
        """An upload of bytes already in memory (not over HTTP)."""
        return cls(file=io.BytesIO(body), size=len(body), sha256=hashlib.sha256(body).hexdigest())

    def read(self) -> bytes:
        self.file.seek(0)
        return self.file.read()


# An upload larger than this is spooled to a temporary file while it arrives.
SPOOL_MEMORY_BYTES = 1024 * 1024


async def receive(chunks: AsyncIterator[bytes], max_bytes: int) -> Upload:
    """Spool a streamed body; 413 as soon as more than max_bytes have arrived (the rest is not
    read). The caller closes upload.file."""
    # Not a with block: the file outlives this function (the caller closes it).
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)  # noqa: SIM115
    digest = hashlib.sha256()
    size = 0
    try:
        async for chunk in chunks:
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLargeError(
                    f"{FIELD}: more than {max_bytes} bytes, the limit (HIGGS_CALIBRATION_MAX_BYTES)"
                )
            digest.update(chunk)
            spool.write(chunk)
    except ClientDisconnect:
        spool.close()
        # Expected (a client gave up or lost its link): one line, nothing stored, no traceback.
        log.warning("calibration upload aborted by the client after %d bytes", size)
        raise UploadAbortedError(
            f"{FIELD}: the client closed the connection after {size} bytes; nothing was stored"
        ) from None
    except BaseException:
        spool.close()
        raise
    return Upload(file=spool, size=size, sha256=digest.hexdigest())


def check_quota(session: Session, key: AuthKey, size: int, settings: Settings) -> None:
    """422 calibration_quota_exceeded when storing `size` more bytes would take the key past
    HIGGS_CALIBRATION_MAX_PER_KEY uploads or HIGGS_CALIBRATION_MAX_TOTAL_BYTES_PER_KEY bytes.
    Call it inside the transaction of the insert, after lock_key: concurrent uploads of one key
    then count one after the other."""
    most, most_bytes = (
        settings.calibration_max_per_key,
        settings.calibration_max_total_bytes_per_key,
    )
    if most <= 0 and most_bytes <= 0:
        return
    count, total = session.execute(
        select(func.count(), func.coalesce(func.sum(Calibration.bytes), 0)).where(
            Calibration.api_key_id == key.id
        )
    ).one()
    retention = (
        f"uploads older than {settings.calibration_retention_days:g} days that no queued or "
        "running job uses are deleted"
        if settings.calibration_retention_days > 0
        else "uploads are kept until an operator deletes them"
    )
    if most > 0 and count >= most:
        raise CalibrationQuotaError(
            f"this API key already stores {count} calibration uploads, the most allowed "
            f"(HIGGS_CALIBRATION_MAX_PER_KEY = {most}); {retention}"
        )
    if most_bytes > 0 and total + size > most_bytes:
        raise CalibrationQuotaError(
            f"this API key stores {total} bytes of calibration text; {size} more would be "
            f"above the limit of {most_bytes} bytes "
            f"(HIGGS_CALIBRATION_MAX_TOTAL_BYTES_PER_KEY); {retention}"
        )


def create(session: Session, key: AuthKey, upload: Upload, settings: Settings) -> Calibration:
    """Check the upload (422 naming the body when empty, binary or not UTF-8; 422
    calibration_quota_exceeded past the key's storage quota) and store it for `key`. Blocking
    database work: run it off the event loop."""
    body = upload.read()
    text = check_text(body)
    lock_key(session, key.id)
    check_quota(session, key, upload.size, settings)
    row = Calibration(
        id=str(uuid.uuid4()),
        api_key_id=key.id,
        sha256=upload.sha256,
        bytes=upload.size,
        text=text,
        created_at=utcnow(),
    )
    session.add(row)
    session.commit()
    return row


def delete_expired(session: Session, older_than: datetime) -> list[str]:
    """Delete the uploads created before `older_than` that no queued or running job uses;
    returns their ids. A job submitted with one meanwhile fails as invalid_config when it runs
    (the upload no longer exists)."""
    old = list(session.scalars(select(Calibration.id).where(Calibration.created_at < older_than)))
    if not old:
        return []
    active = session.scalars(select(Job.config).where(Job.status.in_((QUEUED, RUNNING))))
    used = {c["calibration"].get("id") for c in active if c and c.get("calibration")}
    gone = [cid for cid in old if cid not in used]
    for i in range(0, len(gone), 500):
        session.execute(delete(Calibration).where(Calibration.id.in_(gone[i : i + 500])))
    session.commit()
    return gone


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
