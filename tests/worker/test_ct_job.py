"""A compressed-tensors job in the runner (real migrated database, tiny checkpoint, real
engine): one artifact directory, checked by transformers before success, with per-layer rows;
options.evaluate measures perplexity and KL on the checkpoint transformers loaded; an avg_bits
target is allocated from a profile the worker measures and stores."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.manifest import sha256_file
from app.artifacts.store import uri_path
from app.db.models import Job
from app.settings import Settings
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import TINY_TEXT, files_under
from tests.worker.helpers import create_job, job_row
from worker.config import RunnerConfig
from worker.runner import run_job

CT = {"formats": ["compressed-tensors"]}


def _job(sessions: sessionmaker[Session], job_id: str) -> Job:
    row: Job = job_row(sessions, job_id)
    return row


def test_bits_4_publishes_a_checked_directory_with_evaluation(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    text = tmp_path / "eval.txt"
    text.write_text(TINY_TEXT * 12)
    cfg = dataclasses.replace(runner_cfg, eval_text_file=text, eval_context=64, eval_windows=4)
    body = {"model": {"id": MODEL}, "target": {"bits": 4}, "options": {**CT, "evaluate": True}}
    job_id = create_job(sessions, settings, body)
    out = run_job(sessions, job_id, cfg)
    assert out.status == "succeeded", out.detail
    job = _job(sessions, job_id)
    assert job.report is not None and job.summary is not None
    assert job.report["formats"] == ["compressed-tensors"]
    assert job.report["metrics"]["load_check"]["class"] == "LlamaForCausalLM"
    assert job.summary["ppl_quantized"] > 1 and job.summary["kl"] > 0
    assert len(job.layers) == len(job.report["layers"]) > 0
    assert {layer.type for layer in job.layers} <= {"w4a16-g32", "w4a16-g64", "w4a16-g128"}
    (art,) = job.artifacts
    assert art.format == "compressed-tensors"
    root = uri_path(art.uri)
    on_disk = {p.relative_to(root).as_posix() for p in files_under(root)}
    assert on_disk == {f.path for f in art.files}
    assert {"config.json", "model.safetensors"} <= on_disk
    for f in art.files:
        assert sha256_file(root / f.path) == f.sha256
    model = AutoModelForCausalLM.from_pretrained(str(root))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert files_under(settings.artifacts_path / ".staging") == []


def test_avg_bits_is_allocated_from_a_stored_profile(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    body = {"model": {"id": MODEL}, "target": {"avg_bits": 6.0}, "options": CT}
    job_id = create_job(sessions, settings, body)
    out = run_job(sessions, job_id, runner_cfg)
    assert out.status == "succeeded", out.detail
    job = _job(sessions, job_id)
    assert job.report is not None
    assert job.report["bits_per_weight"] <= 6.0
    assert job.report["metrics"]["service"]["profile"]["reused"] is None  # measured here
    assert job.report["metrics"]["predicted_kl"] > 0
    again = create_job(sessions, settings, body)
    assert run_job(sessions, again, runner_cfg).status == "succeeded"
    second = _job(sessions, again)
    assert second.report is not None
    assert second.report["metrics"]["service"]["profile"]["reused"] is not None
