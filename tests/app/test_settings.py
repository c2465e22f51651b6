"""Settings: everything derives from one data directory unless the environment says otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.db.session import normalise_url
from app.settings import Settings


def test_defaults_live_under_the_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "HIGGS_DATABASE_URL",
        "HIGGS_BROKER_URL",
        "HIGGS_ARTIFACTS_DIR",
        "HIGGS_MODELS_DIR",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HIGGS_DATA_DIR", str(tmp_path / "d"))
    s = Settings()
    assert s.data_dir == (tmp_path / "d").resolve()
    assert s.database_url == f"sqlite:///{tmp_path.resolve() / 'd' / 'higgs.db'}"
    assert s.broker_url == "filesystem://" and s.is_filesystem_broker
    assert s.artifacts_path == (tmp_path / "d" / "artifacts").resolve()
    assert Path(s.broker_transport_options()["data_folder_in"]).is_relative_to(s.data_dir)
    s.ensure_dirs()
    assert (
        s.artifacts_path.is_dir() and Path(s.broker_transport_options()["control_folder"]).is_dir()
    )
    # A presigned store URL outlives a revoked key until it expires: minutes, not a quarter hour.
    assert 60 <= s.artifacts_redirect_ttl_s <= 300


def test_environment_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIGGS_DATABASE_URL", "postgresql://u:p@db:5432/higgs")
    monkeypatch.setenv("HIGGS_BROKER_URL", "redis://redis:6379/0")
    monkeypatch.setenv("HIGGS_MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("HIGGS_MAX_BODY_BYTES", "1024")
    monkeypatch.setenv("HIGGS_DYNAMIC_TARGETS", "true")
    s = Settings()
    assert normalise_url(s.database_url) == "postgresql+psycopg://u:p@db:5432/higgs"
    assert s.broker_transport_options() == {} and not s.is_filesystem_broker
    assert s.models_dir == tmp_path.resolve() and s.max_body_bytes == 1024 and s.dynamic_targets


def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIGGS_MAX_BODY_BYTES", "-5")
    with pytest.raises(ValidationError, match="max_body_bytes"):
        Settings()


def test_worker_device_and_evaluation_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = tmp_path / "eval.txt"
    monkeypatch.setenv("HIGGS_EVAL_TEXT_FILE", str(text))
    monkeypatch.setenv("HIGGS_EVAL_WINDOWS", "3")
    monkeypatch.setenv("HIGGS_DEVICE", "cuda:1")
    s = Settings()
    assert s.eval_text_file == text.resolve() and s.eval_windows == 3 and s.eval_context == 512
    assert s.device == "cuda:1"
    assert Settings(device="cpu").device == "cpu"
    monkeypatch.setenv("HIGGS_DEVICE", "gpu")
    with pytest.raises(ValidationError, match="'gpu'"):
        Settings()


def test_empty_variables_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIGGS_EVAL_TEXT_FILE", "")
    monkeypatch.setenv("HIGGS_HF_TOKEN", "")
    monkeypatch.setenv("HIGGS_DEVICE", "")
    s = Settings()
    assert s.eval_text_file is None and s.hf_token is None and s.device == "auto"
