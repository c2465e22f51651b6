"""The registry of local models: which model names the workers can read from their models
directory, so that the API checks a submitted name without a disk of its own.

A worker registers the checkpoint folders of its HIGGS_MODELS_DIR (each with a config.json)
when it starts and again on every sweep (seen_at), and removes its rows when it stops; an
operator registers names by hand with `higgs models register` (rows without seen_at, never
stale). The API treats a worker's row as gone once it was not refreshed for `stale_after_s`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session, sessionmaker

from app.db.base import utcnow
from app.db.models import LocalModel
from app.settings import Settings

OPERATOR = "operator"


def scan_models_dir(models_dir: Path) -> list[str]:
    """Names of the checkpoint folders directly under models_dir (those with a config.json)."""
    if not models_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in models_dir.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / "config.json").is_file()
    )


def read_architecture(checkpoint: Path) -> str | None:
    """The first `architectures` entry of checkpoint/config.json, or None (missing, unreadable
    or without one)."""
    import json

    try:
        cfg = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0][:128]
    return None


def register(
    session: Session,
    names: Iterable[str],
    holder: str,
    *,
    now: datetime | None = None,
    architectures: dict[str, str | None] | None = None,
) -> None:
    """`holder` (a worker id, or OPERATOR) has exactly these names now: its other rows go.
    Workers' rows get seen_at = now; the operator's have none (they never go stale).
    `architectures`: each name's config.json architecture, stored on its row."""
    names = sorted(set(names))
    archs = architectures or {}
    seen = None if holder == OPERATOR else (now or utcnow())
    existing = set(
        session.scalars(select(LocalModel.name).where(LocalModel.holder == holder)).all()
    )
    if holder != OPERATOR:
        session.execute(
            delete(LocalModel).where(LocalModel.holder == holder, LocalModel.name.not_in(names))
        )
        for row in session.scalars(select(LocalModel).where(LocalModel.holder == holder)):
            row.seen_at = seen
            if row.name in archs:
                row.architecture = archs[row.name]
    session.add_all(
        LocalModel(name=n, holder=holder, seen_at=seen, architecture=archs.get(n))
        for n in names
        if n not in existing
    )
    session.commit()


def unregister(session: Session, holder: str, names: Iterable[str] | None = None) -> int:
    """Remove the holder's rows (all of them, or these names). Returns how many went."""
    stmt = delete(LocalModel).where(LocalModel.holder == holder)
    if names is not None:
        stmt = stmt.where(LocalModel.name.in_(list(names)))
    n = session.execute(stmt).rowcount  # type: ignore[attr-defined]
    session.commit()
    return int(n or 0)


def _live(stale_after_s: float, now: datetime | None) -> object:
    cutoff = (now or utcnow()) - timedelta(seconds=stale_after_s)
    return or_(LocalModel.seen_at.is_(None), LocalModel.seen_at >= cutoff)


def any_registered(session: Session, stale_after_s: float, now: datetime | None = None) -> bool:
    found = session.scalar(select(LocalModel.name).where(_live(stale_after_s, now)).limit(1))  # type: ignore[arg-type]
    session.rollback()
    return found is not None


def is_registered(
    session: Session, name: str, stale_after_s: float, now: datetime | None = None
) -> bool:
    found = session.scalar(
        select(LocalModel.name).where(LocalModel.name == name, _live(stale_after_s, now)).limit(1)  # type: ignore[arg-type]
    )
    session.rollback()
    return found is not None


@dataclass(frozen=True)
class Registered:
    name: str
    holder: str
    seen_at: datetime | None


def listing(session: Session) -> list[Registered]:
    rows = session.execute(
        select(LocalModel.name, LocalModel.holder, LocalModel.seen_at).order_by(
            LocalModel.name, LocalModel.holder
        )
    ).all()
    session.rollback()
    return [Registered(n, h, s) for n, h, s in rows]


class Registry:
    """What the API asks about local names (app.jobs.model_ref.LocalNames), one short
    session per question; rows of workers not seen for stale_after_s do not count."""

    def __init__(self, sessions: sessionmaker[Session], stale_after_s: float) -> None:
        self.sessions = sessions
        self.stale_after_s = stale_after_s

    def has(self, name: str) -> bool:
        with self.sessions() as s:
            return is_registered(s, name, self.stale_after_s)

    def any(self) -> bool:
        with self.sessions() as s:
            return any_registered(s, self.stale_after_s)

    def architecture(self, name: str) -> str | None:
        """The architecture a live row of `name` records (None: unknown)."""
        with self.sessions() as s:
            found = s.scalar(
                select(LocalModel.architecture)
                .where(
                    LocalModel.name == name,
                    LocalModel.architecture.is_not(None),
                    _live(self.stale_after_s, None),  # type: ignore[arg-type]
                )
                .limit(1)
            )
            s.rollback()
            return found


def stale_after_s(settings: Settings) -> float:
    """A worker refreshes its rows on every sweep: after three missed sweeps (and at least a
    heartbeat timeout) its models count as gone."""
    return max(3 * settings.sweep_interval_s, settings.heartbeat_timeout_s)
