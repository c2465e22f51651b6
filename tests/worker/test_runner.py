"""The runner against a real (migrated) SQLite database, real tiny checkpoints and the real
engine; the task function is called directly, without Celery."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.manifest import sha256_file
from app.artifacts.store import uri_path
from app.db.models import Job
from app.jobs import state
from app.settings import Settings
from higgs_engine.errors import CancelledError, InvalidConfigError, ModelNotFoundError
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import files_under, make_hub_cache
from tests.worker.helpers import cancel_mid_run, create_job, job_row
from worker.attempt import job_error_code
from worker.config import RunnerConfig
from worker.progress import ProgressWriter
from worker.runner import run_job

BODY = {"model": {"id": MODEL}, "target": {"bits": 4}}


def _job(sessions: sessionmaker[Session], job_id: str) -> Job:
    row: Job = job_row(sessions, job_id)
    return row


def test_job_runs_to_success_with_checksummed_artifacts(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    job_id = create_job(sessions, settings, BODY)
    out = run_job(sessions, job_id, runner_cfg, worker_id="w1")
    assert out.status == "succeeded", out.detail

    job = _job(sessions, job_id)
    assert job.status == "succeeded" and job.attempts == 1 and job.worker_id == "w1"
    assert job.error_code is None and job.model_revision is None  # a local model has no sha
    assert {"loading", "quantizing", "packaging"} <= set(job.stage_durations or {})
    assert job.report is not None and job.report["source"]["id"] == MODEL
    assert job.report["source"]["kind"] == "local"
    assert job.report["metrics"]["device"] == "cpu"  # the runner's device reached the engine
    assert job.summary is not None and job.summary["bits_per_weight"] > 4.0
    assert len(job.layers) == len(job.report["layers"]) > 0
    assert sorted(a.format for a in job.artifacts) == ["dequantized", "native"]
    for art in job.artifacts:
        root = uri_path(art.uri)
        assert root.is_relative_to(settings.artifacts_path / job_id)
        on_disk = {p.relative_to(root).as_posix() for p in files_under(root)}
        assert on_disk == {f.path for f in art.files}
        for f in art.files:
            assert sha256_file(root / f.path) == f.sha256
            assert (root / f.path).stat().st_size == f.bytes
    # One published attempt, nothing left in staging.
    assert len(list((settings.artifacts_path / job_id).iterdir())) == 1
    assert files_under(settings.artifacts_path / ".staging") == []


def test_duplicate_delivery_is_a_no_op(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    job_id = create_job(sessions, settings, BODY)
    assert run_job(sessions, job_id, runner_cfg).status == "succeeded"
    before = files_under(settings.artifacts_path)
    assert run_job(sessions, job_id, runner_cfg).status == "skipped"
    assert files_under(settings.artifacts_path) == before
    assert _job(sessions, job_id).attempts == 1


def test_unknown_job_id_is_skipped(
    sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    assert run_job(sessions, "no-such-job", runner_cfg).status == "skipped"


def test_cancel_while_running_leaves_nothing(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    job_id = create_job(sessions, settings, BODY)
    slow = dataclasses.replace(runner_cfg, debug_layer_delay_s=0.3, progress_min_interval_s=0.0)
    outcome = cancel_mid_run(
        sessions,
        job_id,
        lambda: run_job(sessions, job_id, slow),
        lambda: _job(sessions, job_id).stage == "quantizing",
        "the quantizing stage",
        timeout=30,
    )
    assert outcome.status == "cancelled"
    job = _job(sessions, job_id)
    assert job.status == "cancelled" and job.artifacts == [] and job.layers == []
    assert files_under(settings.artifacts_path) == []


def test_cancel_before_the_worker_starts(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    job_id = create_job(sessions, settings, BODY)
    with sessions() as s:
        state.request_cancel(s, job_id)
    assert run_job(sessions, job_id, runner_cfg).status == "skipped"
    assert _job(sessions, job_id).status == "cancelled"


def test_missing_local_model_fails_with_model_not_found(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig, tmp_path: Path
) -> None:
    job_id = create_job(sessions, settings, BODY)
    # The model directory disappeared between submit and run.
    cfg = dataclasses.replace(runner_cfg, models_dir=tmp_path / "empty-models")
    (tmp_path / "empty-models").mkdir()
    out = run_job(sessions, job_id, cfg)
    assert out.status == "failed"
    job = _job(sessions, job_id)
    assert job.status == "failed" and job.error_code == "model_not_found"
    assert MODEL in (job.error_message or "")
    assert files_under(settings.artifacts_path) == []


def test_corrupt_checkpoint_fails_cleanly(
    settings: Settings,
    sessions: sessionmaker[Session],
    runner_cfg: RunnerConfig,
    tmp_path: Path,
    models_dir: Path,
) -> None:
    job_id = create_job(sessions, settings, BODY)
    broken = tmp_path / "broken-models"
    (broken / MODEL).mkdir(parents=True)
    (broken / MODEL / "config.json").write_text((models_dir / MODEL / "config.json").read_text())
    (broken / MODEL / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    out = run_job(sessions, job_id, dataclasses.replace(runner_cfg, models_dir=broken))
    assert out.status == "failed"
    job = _job(sessions, job_id)
    assert job.error_code in ("corrupt_checkpoint", "unsupported_model"), job.error_message
    assert files_under(settings.artifacts_path) == []


def test_hub_model_offline_records_the_commit_sha(
    settings: Settings,
    sessions: sessionmaker[Session],
    runner_cfg: RunnerConfig,
    tmp_path: Path,
    models_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import huggingface_hub.constants as hf_constants

    hub_cache = tmp_path / "hf" / "hub"
    sha = make_hub_cache(hub_cache, "acme/tiny-llama", models_dir / MODEL)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    cfg = dataclasses.replace(runner_cfg, hf_offline=True)

    job_id = create_job(
        sessions, settings, {"model": {"id": "acme/tiny-llama"}, "target": {"bits": 3}}
    )
    out = run_job(sessions, job_id, cfg)
    assert out.status == "succeeded", out.detail
    job = _job(sessions, job_id)
    assert job.model_revision == sha
    assert job.report is not None
    assert job.report["source"] == {
        **job.report["source"],
        "id": "acme/tiny-llama",
        "revision": sha,
        "kind": "hub",
    }

    missing = create_job(
        sessions, settings, {"model": {"id": "acme/absent"}, "target": {"bits": 4}}
    )
    assert run_job(sessions, missing, cfg).status == "failed"
    job = _job(sessions, missing)
    assert job.error_code == "model_not_found" and "offline" in (job.error_message or "")


def test_progress_writer_throttles_and_reports_cancel(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    job_id = create_job(sessions, settings, BODY)
    with sessions() as s:
        assert state.claim(s, job_id, "w") is not None
    now = [0.0]
    writer = ProgressWriter(sessions, job_id, "w", min_interval=1.0, clock=lambda: now[0])
    assert writer("quantizing", 0, 10) is True  # new stage: written
    assert writer("quantizing", 1, 10) is True  # within 1 s: not written
    assert _job(sessions, job_id).progress_done == 0
    now[0] = 2.0
    assert writer("quantizing", 2, 10) is True
    assert _job(sessions, job_id).progress_done == 2
    with sessions() as s:
        state.request_cancel(s, job_id)
    now[0] = 4.0
    assert writer("quantizing", 3, 10) is False
    assert writer("quantizing", 4, 10) is False  # stays stopped without another write


def test_progress_writer_stops_when_the_job_is_no_longer_ours(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    job_id = create_job(sessions, settings, BODY)
    with sessions() as s:
        assert state.claim(s, job_id, "w-old") is not None
    writer = ProgressWriter(sessions, job_id, "w-new", min_interval=0.0)
    assert writer("loading", 0, 1) is False


def test_error_codes() -> None:
    assert job_error_code(ModelNotFoundError("x")) == "model_not_found"
    assert job_error_code(InvalidConfigError("x")) == "invalid_config"
    assert job_error_code(CancelledError("x")) == "engine_error"
    assert job_error_code(MemoryError()) == "out_of_memory"
    assert job_error_code(RuntimeError("boom")) == "internal_error"
    from billiard.exceptions import SoftTimeLimitExceeded

    assert job_error_code(SoftTimeLimitExceeded()) == "time_limit"


def test_evaluate_records_perplexity_and_kl(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig, tmp_path: Path
) -> None:
    from tests.fixtures import TINY_TEXT

    text = tmp_path / "eval.txt"
    text.write_text(TINY_TEXT * 12)
    cfg = dataclasses.replace(runner_cfg, eval_text_file=text, eval_context=64, eval_windows=4)
    job_id = create_job(
        sessions, settings, {**BODY, "options": {"evaluate": True, "formats": ["native"]}}
    )
    out = run_job(sessions, job_id, cfg)
    assert out.status == "succeeded", out.detail
    job = _job(sessions, job_id)
    assert job.summary is not None and job.report is not None
    assert (
        job.summary["ppl_base"] > 1 and job.summary["ppl_quantized"] > 1 and job.summary["kl"] > 0
    )
    assert job.report["metrics"]["eval_windows"] == 4 and "evaluating" in job.report["timings"]
    assert [a.format for a in job.artifacts] == ["native"]


@pytest.mark.parametrize("formats", [["native", "dequantized"], ["gguf"]])
def test_evaluate_without_a_text_fails_before_quantizing(
    settings: Settings,
    sessions: sessionmaker[Session],
    runner_cfg: RunnerConfig,
    formats: list[str],
) -> None:
    job_id = create_job(
        sessions, settings, {**BODY, "options": {"evaluate": True, "formats": formats}}
    )
    assert (
        run_job(sessions, job_id, dataclasses.replace(runner_cfg, eval_text_file=None)).status
        == "failed"
    )
    job = _job(sessions, job_id)
    assert job.error_code == "invalid_config" and "HIGGS_EVAL_TEXT_FILE" in (
        job.error_message or ""
    )
    assert "quantizing" not in (job.stage_durations or {})


def test_runner_config_reads_the_evaluation_settings(settings: Settings, tmp_path: Path) -> None:
    text = tmp_path / "news.txt"
    s = settings.model_copy(update={"eval_text_file": text, "eval_windows": 5, "eval_context": 128})
    cfg = RunnerConfig.from_settings(s, "cpu")
    assert (cfg.eval_text_file, cfg.eval_windows, cfg.eval_context) == (text, 5, 128)


def test_worker_device_choice(tmp_path: Path) -> None:
    import torch

    from worker.celery_app import detect_device, make_celery

    assert detect_device("cpu") == "cpu"
    assert detect_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        # Asked for but unusable: logged, and the jobs run on the CPU rather than fail.
        assert detect_device("cuda") == "cpu"
    conf = make_celery(Settings(data_dir=tmp_path, worker_max_memory_mb=512)).conf
    assert conf.worker_max_memory_per_child == 512 * 1024 and not conf.worker_max_tasks_per_child
