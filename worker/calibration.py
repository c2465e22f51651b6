"""A job's calibration text (options.calibration: an uploaded text) as the engine's
Calibration: read from the database, checked against what was submitted, and tokenized with
the model's tokenizer before any quantization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from higgs_engine.errors import InvalidConfigError
from worker.dbretry import SessionFactory, retry_db


def load_job_calibration(
    sessions: SessionFactory, entry: dict[str, Any] | None, model_path: Path, budget_s: float
) -> Any:
    """The engine Calibration for a job config's `calibration` entry (an uploaded text), or
    None. InvalidConfigError (the job fails, code invalid_config) when the upload is gone or
    the text has fewer tokens than the job asks for."""
    if not entry:
        return None
    from app.db.models import Calibration as CalibrationRow
    from higgs_engine.calibration import prepare_calibration

    def load() -> tuple[str, str] | None:
        with sessions() as s:
            row = s.get(CalibrationRow, entry["id"])
            return None if row is None else (row.text, row.sha256)

    found = retry_db(load, f"calibration {entry['id']}", budget_s)
    if found is None:
        raise InvalidConfigError(
            f"options.calibration: the upload {entry['id']!r} no longer exists"
        )
    text, sha = found
    if sha != entry.get("sha256"):
        raise InvalidConfigError(
            f"options.calibration: the upload {entry['id']!r} changed since submit"
        )
    try:
        return prepare_calibration(
            model_path, text, int(entry["tokens"]), label=f"upload:{entry['id']}"
        )
    except InvalidConfigError as exc:
        raise InvalidConfigError(f"options.calibration: {exc}") from exc
