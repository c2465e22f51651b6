"""A job's calibration text (options.calibration: an uploaded text) as the engine's
CalibrationRequest: read from the database and checked against what was submitted; the
engine tokenizes it with the model's tokenizer before any quantization."""

from __future__ import annotations

from typing import Any

from higgs_engine.errors import InvalidConfigError
from higgs_engine.job import CalibrationRequest
from worker.dbretry import SessionFactory, retry_db


def load_job_calibration(
    sessions: SessionFactory, entry: dict[str, Any] | None, budget_s: float
) -> CalibrationRequest | None:
    """The engine CalibrationRequest for a job config's `calibration` entry (an uploaded
    text), or None; the engine tokenizes it with the model's tokenizer once the model is
    resolved, before any quantization. InvalidConfigError (the job fails, code
    invalid_config) when the upload is gone or changed, or (then) when the text has fewer
    tokens than the job asks for."""
    if not entry:
        return None
    from app.db.models import Calibration as CalibrationRow

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
    return CalibrationRequest(
        text, int(entry["tokens"]), label=f"upload:{entry['id']}", field="options.calibration"
    )
