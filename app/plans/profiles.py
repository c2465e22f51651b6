"""The service's index of complete sensitivity profiles (the `profiles` table).

One row per (model id, revision, metric, calibration, token budget). `data` is
    {"version": 1, "key": <engine cache key>, "profile": <higgs_engine Profile.to_dict()>,
     "source": {"id", "kind", "revision", "requested_revision"}}
`revision` is the Hub commit sha the profile was measured on, or for a local model the
engine's content fingerprint ("local:<hex>"), so a changed checkpoint is never matched with an
old profile. Written by the worker, read by the worker (reuse) and by POST /v1/plans.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import Profile

DATA_VERSION = 1


def text_hash(calibration: str) -> str:
    """The table's text_hash column from the engine's calibration id ("text:<sha256>" or
    "random:<seed>"): the sha256 alone for text (the column holds 64 characters)."""
    return calibration.removeprefix("text:")


def profile_payload(row: Profile) -> dict[str, Any] | None:
    """The engine profile dict of a row, or None when the row is not one this service wrote
    (an unknown data version or a partial profile is never planned with)."""
    data = row.data or {}
    prof = data.get("profile") if isinstance(data, dict) else None
    if data.get("version") != DATA_VERSION or not isinstance(prof, dict):
        return None
    return prof if prof.get("complete") else None


def find_profiles(
    session: Session,
    model_id: str,
    revision: str | None = None,
    metric: str | None = None,
    *,
    calibration: str | None = None,
    token_budget: int | None = None,
) -> list[Profile]:
    """Usable rows for the model, newest first. `revision` matches the stored revision (sha or
    fingerprint) or the revision the job asked for (a branch or tag name)."""
    stmt = select(Profile).where(Profile.model_id == model_id)
    if metric is not None:
        stmt = stmt.where(Profile.metric == metric)
    if calibration is not None:
        stmt = stmt.where(Profile.text_hash == text_hash(calibration))
    if token_budget is not None:
        stmt = stmt.where(Profile.token_budget == token_budget)
    rows = session.scalars(stmt.order_by(Profile.created_at.desc(), Profile.id.desc())).all()
    out = []
    for row in rows:
        if profile_payload(row) is None:
            continue
        src = (row.data or {}).get("source") or {}
        if revision is not None and revision not in (row.revision, src.get("requested_revision")):
            continue
        out.append(row)
    return out


def store_profile(
    session: Session,
    *,
    model_id: str,
    revision: str,
    profile: dict[str, Any],
    key: str,
    source: dict[str, Any],
) -> Profile:
    """Insert or replace the row for this profile's key columns and commit. Two workers that
    profiled the same model at once both succeed: the later write wins, both rows are equal
    up to timing figures."""
    cfg = profile["config"]
    columns = {
        "model_id": model_id,
        "revision": revision,
        "metric": str(cfg["metric"]),
        "text_hash": text_hash(str(profile["calibration"])),
        "token_budget": int(cfg["windows"]) * int(cfg["context"]),
    }
    data = {"version": DATA_VERSION, "key": key, "profile": profile, "source": source}
    for _ in range(2):
        row = session.scalar(select(Profile).filter_by(**columns))
        if row is None:
            row = Profile(**columns, data=data, created_at=utcnow())
            session.add(row)
        else:
            row.data = data
            row.created_at = utcnow()
        try:
            session.commit()
            return row
        except IntegrityError:  # another worker inserted it meanwhile: update theirs
            session.rollback()
    raise RuntimeError(f"could not store the profile of {model_id!r}")  # pragma: no cover
