"""The stored job config: the shapes jobs.config has held load, anything else is refused."""

from __future__ import annotations

from typing import Any

import pytest

from app.jobs.job_config import JobConfig
from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.config import HiggsConfig

ENGINE = HiggsConfig(p=2, n=16).to_dict()


def test_the_stored_version_1_shape_loads_and_round_trips() -> None:
    stored = {"version": 1, "engine": ENGINE, "target": {"bits": 2.0}, "evaluate": True}
    cfg = JobConfig.load(stored)
    assert cfg.to_dict() == stored
    assert (cfg.target_kind, cfg.target_value, cfg.is_dynamic) == ("bits", 2.0, False)
    assert cfg.higgs_config() == HiggsConfig(p=2, n=16)


def test_an_early_row_without_evaluate_loads_as_false() -> None:
    cfg = JobConfig.load({"version": 1, "engine": ENGINE, "target": {"avg_bits": 3.5}})
    assert cfg.evaluate is False and cfg.is_dynamic and cfg.target_value == 3.5


def test_a_dynamic_config_keeps_its_menu_restriction() -> None:
    stored = {
        "version": 1,
        "engine": ENGINE,
        "target": {"avg_bits": 3.0},
        "evaluate": False,
        "menu_p": 1,
    }
    cfg = JobConfig.load(stored)
    assert cfg.menu_p == 1 and cfg.to_dict() == stored
    assert "menu_p" not in JobConfig.load({**stored, "menu_p": None}).to_dict()


@pytest.mark.parametrize(
    "stored",
    [
        {"version": 2, "engine": ENGINE, "target": {"bits": 2.0}},
        {"engine": ENGINE, "target": {"bits": 2.0}},
        {"version": 1, "engine": ENGINE, "target": {"bits": 2.0, "avg_bits": 3.0}},
        {"version": 1, "engine": ENGINE, "target": {"size": 2.0}},
        {"version": 1, "engine": {**ENGINE, "p": 3}, "target": {"bits": 2.0}},
        {"version": 1, "engine": ENGINE, "target": {"bits": 2.0}, "extra": 1},
    ],
)
def test_anything_else_is_refused_naming_the_config(stored: dict[str, Any]) -> None:
    with pytest.raises(InvalidConfigError) as info:
        JobConfig.load(stored)
    assert info.value.field == "config"


def test_gguf_rotate_is_stored_only_when_asked_for(tmp_path: Any) -> None:
    stored = {
        "version": 1,
        "engine": ENGINE,
        "target": {"avg_bits": 5.0},
        "evaluate": False,
        "gguf": True,
        "gguf_rotate": "auto",
    }
    cfg = JobConfig.load(stored)
    assert cfg.gguf_rotate == "auto" and cfg.to_dict() == stored
    for absent in (None, "off"):
        assert "gguf_rotate" not in JobConfig.load({**stored, "gguf_rotate": absent}).to_dict()


def test_gguf_rotate_request(tmp_path: Any) -> None:
    from app.errors import ValidationFailedError
    from app.jobs.schemas import JobCreate
    from app.jobs.service import validate_request
    from app.settings import Settings

    settings = Settings(data_dir=tmp_path)
    body: dict[str, Any] = {
        "model": {"id": "org/model"},
        "target": {"avg_bits": 5.0},
        "options": {"formats": ["gguf"], "gguf_rotate": "auto"},
    }
    spec = validate_request(JobCreate.model_validate(body), settings)
    assert spec.config.gguf_rotate == "auto"
    assert spec.request["options"]["gguf_rotate"] == "auto"
    # not asked for: the stored request (and its hash) keeps its old shape
    plain = {**body, "options": {"formats": ["gguf"]}}
    spec = validate_request(JobCreate.model_validate(plain), settings)
    assert spec.config.gguf_rotate is None and "gguf_rotate" not in spec.request["options"]
    with pytest.raises(ValidationFailedError) as e:
        validate_request(
            JobCreate.model_validate({**body, "options": {"gguf_rotate": "on"}}), settings
        )
    assert str(e.value).startswith("options.gguf_rotate: ")
