"""Submitting a compressed-tensors job: `formats: ["compressed-tensors"]` is stored as a ct job
with its dtype, and what it cannot be asked for is a 422 naming the field, with nothing
created."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.db.models import Job
from app.settings import Settings
from tests.fixtures import assert_problem

CT: dict[str, Any] = {"formats": ["compressed-tensors"]}


def submit(client: TestClient, auth: dict[str, str], body: dict[str, Any]) -> Any:
    return client.post("/v1/jobs", json=body, headers=auth)


@pytest.mark.parametrize(
    ("target", "options"),
    [({"bits": 4}, {}), ({"bits": 8}, {"dtype": "bfloat16"}), ({"avg_bits": 5.0}, {})],
)
def test_a_ct_job_is_stored_as_one(
    client: TestClient, auth: dict[str, str], target: dict[str, float], options: dict[str, Any]
) -> None:
    body = {"model": {"id": "tiny"}, "target": target, "options": {**CT, **options}}
    r = submit(client, auth, body)
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["config"]["ct"] is True and "gguf" not in job["config"]
    assert job["config"]["engine"]["dtype"] == options.get("dtype", "float16")
    assert job["request"]["options"]["formats"] == ["compressed-tensors"]


@pytest.mark.parametrize(
    ("target", "options", "field"),
    [
        ({"bits": 3}, {}, "target.bits"),
        ({"bits": 4.5}, {}, "target.bits"),
        ({"avg_bits": 3.5}, {}, "target.avg_bits"),
        ({"bits": 4}, {"formats": ["compressed-tensors", "native"]}, "options.formats"),
        ({"bits": 4}, {"dtype": "float32"}, "options.dtype"),
        ({"bits": 4}, {"group_size": 128}, "options.group_size"),
        ({"bits": 4}, {"p": 2}, "options.p"),
        ({"bits": 4}, {"method": "rtn"}, "options.method"),
        ({"bits": 4}, {"scope": "all"}, "options.scope"),
        # calibration is taken, but only an upload of this key's
        ({"bits": 4}, {"calibration": "abc"}, "options.calibration"),
    ],
)
def test_what_a_ct_job_cannot_take_is_422_naming_the_field(
    client: TestClient,
    auth: dict[str, str],
    sessions: Any,
    target: dict[str, float],
    options: dict[str, Any],
    field: str,
) -> None:
    body = {"model": {"id": "tiny"}, "target": target, "options": {**CT, **options}}
    problem = assert_problem(submit(client, auth, body), 422, field)
    assert problem["detail"]
    with sessions() as s:
        assert s.scalars(select(Job)).all() == []


@pytest.mark.parametrize(
    ("architecture", "needle"), [("GPT2LMHeadModel", "Conv1D"), ("Foo", "no model class Foo")]
)
def test_an_architecture_transformers_cannot_load_is_422_naming_formats(
    client: TestClient, auth: dict[str, str], settings: Settings, architecture: str, needle: str
) -> None:
    assert settings.models_dir is not None
    models = Path(settings.models_dir)
    (models / "tiny" / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    body = {"model": {"id": "tiny"}, "target": {"bits": 4}, "options": CT}
    problem = assert_problem(submit(client, auth, body), 422, "options.formats")
    assert needle in problem["detail"]
