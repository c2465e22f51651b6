"""A job naming an uploaded calibration text runs calibrated HIGGS (or, for compressed-tensors,
GPTQ in each layer's scheme); an unusable text fails the job before anything is quantized."""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.store import uri_path
from app.calibrations.service import Upload
from app.calibrations.service import create as create_upload
from app.db.models import Job
from app.jobs.schemas import JobCreate
from app.jobs.service import create_job, validate_request, with_calibration
from app.keys.service import AuthKey, create_key
from app.settings import Settings
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import TINY_TEXT, files_under
from worker.config import RunnerConfig
from worker.runner import run_job


def _submit(
    sessions: sessionmaker[Session],
    settings: Settings,
    text: bytes,
    tokens: int,
    options: dict[str, Any] | None = None,
) -> tuple[str, str]:
    """Upload `text` and submit a job using it, as the API does. Returns (job id, upload id)."""
    body: dict[str, Any] = {
        "model": {"id": MODEL},
        "target": {"bits": 4},
        "options": {"calibration_tokens": tokens, **(options or {})},
    }
    with sessions() as s:
        row, _ = create_key(s, "cal")
        key = AuthKey.of(row)
        up = create_upload(s, key, Upload.of(text), settings)
        body["options"]["calibration"] = up.id
        req = JobCreate.model_validate(body)
        spec = with_calibration(s, key, req, validate_request(req, settings))
        job, _ = create_job(s, key, spec, None)
        return job.id, up.id


def test_calibrated_job_records_the_text(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    text = (TINY_TEXT * 20).encode()
    job_id, up_id = _submit(sessions, settings, text, 256)
    out = run_job(sessions, job_id, runner_cfg, worker_id="w1")
    assert out.status == "succeeded", out.detail
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.report is not None and job.summary is not None
        cal = job.report["metrics"]["calibration"]
        assert cal["source"] == f"upload:{up_id}" and cal["tokens"] == 256
        assert cal["sha256"] == hashlib.sha256(text).hexdigest()
        assert cal["layers_calibrated"] == job.report["metrics"]["quantized_layers"]
        assert job.summary["calibration"] == {
            "source": f"upload:{up_id}",
            "sha256": cal["sha256"],
            "tokens": 256,
        }
        assert "calibrating" in (job.stage_durations or {})


def test_calibrated_compressed_tensors_job_runs_gptq_in_each_scheme(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    text = (TINY_TEXT * 20).encode()
    job_id, up_id = _submit(sessions, settings, text, 256, {"formats": ["compressed-tensors"]})
    out = run_job(sessions, job_id, runner_cfg, worker_id="w1")
    assert out.status == "succeeded", out.detail
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.report is not None and job.summary is not None
        metrics = job.report["metrics"]
        cal = metrics["calibration"]
        assert cal["source"] == f"upload:{up_id}" and cal["tokens"] == 256
        assert cal["method"] == "gptq" and cal["layers_calibrated"] > 0
        assert cal["sha256"] == hashlib.sha256(text).hexdigest()
        # transformers loaded what GPTQ wrote, before the job succeeded
        assert metrics["load_check"]["class"] == "LlamaForCausalLM"
        assert job.summary["calibration"]["source"] == f"upload:{up_id}"
        assert "calibrating" in (job.stage_durations or {})
        (art,) = job.artifacts
        assert art.format == "compressed-tensors"
        assert (uri_path(art.uri) / "model.safetensors").is_file()


def test_too_few_tokens_fails_before_quantizing(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    # As many tokens asked for as the text has bytes passes the API's check; the tokenizer
    # merges bytes, so the text has fewer tokens than that.
    text = TINY_TEXT.encode()
    job_id, _ = _submit(sessions, settings, text, len(text))
    stages: list[str] = []
    out = run_job(sessions, job_id, runner_cfg, worker_id="w1")
    assert out.status == "failed"
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        assert job.error_code == "invalid_config", job.error_code
        assert "options.calibration" in (job.error_message or "")
        assert f"fewer than the {len(text)} requested" in (job.error_message or "")
        stages = list((job.stage_durations or {}).keys())
    assert "quantizing" not in stages and "calibrating" not in stages
    assert files_under(settings.artifacts_path) == []
