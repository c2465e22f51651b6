"""Rows inserted directly (for state-machine and artifact tests)."""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import ApiKey, Job
from app.keys.service import create_key


def make_key(session: Session, name: str = "test") -> tuple[ApiKey, str]:
    return create_key(session, name)


def make_job(session: Session, api_key_id: str, *, age_s: float = 0.0, **kw: object) -> Job:
    created = utcnow() - timedelta(seconds=age_s)
    job = Job(
        id=str(uuid.uuid4()),
        api_key_id=api_key_id,
        request_hash="0" * 64,
        request={"model": {"id": "tiny"}, "target": {"bits": 4}},
        config={"version": 1, "engine": {}, "target": {"bits": 4}, "evaluate": False},
        model_id="tiny",
        created_at=created,
        updated_at=created,
        **kw,
    )
    session.add(job)
    session.commit()
    return job
