"""Hostile and sloppy input: every value the API once took and should not have is now a 422
naming the right field, and nothing is stored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.db.models import Job
from app.jobs.service import config_error_field
from app.settings import Settings
from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.config import HiggsConfig
from tests.fixtures import assert_problem

GRID = {"p": 2, "n": 256}


def submit_raw(client: TestClient, auth: dict[str, str], text: str) -> Any:
    return client.post(
        "/v1/jobs", content=text, headers={**auth, "Content-Type": "application/json"}
    )


def no_jobs(sessions: sessionmaker[Session]) -> None:
    with sessions() as s:
        assert s.scalars(select(Job)).all() == []


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("kind", ["bits", "avg_bits", "max_ppl_increase"])
def test_nan_and_infinity_targets_are_refused(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    value: str,
    kind: str,
) -> None:
    options = json.dumps(GRID if kind == "bits" else {"p": 2})
    text = f'{{"model": {{"id": "tiny"}}, "target": {{"{kind}": {value}}}, "options": {options}}}'
    r = submit_raw(client, auth, text)
    if r.status_code == 400:  # a JSON parser that refuses the literal is as good
        assert_problem(r, 400)
    else:
        assert_problem(r, 422, f"target.{kind}")
    no_jobs(sessions)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        # Strict types: no bool-as-number, no string-as-bool, no float-as-int.
        ({"target": {"bits": True}}, "target.bits"),
        ({"target": {"bits": "4"}}, "target.bits"),
        ({"target": {"bits": 4}, "options": {"evaluate": "yes"}}, "options.evaluate"),
        ({"target": {"bits": 4}, "options": {"evaluate": 1}}, "options.evaluate"),
        ({"target": {"bits": 4}, "options": {"p": True}}, "options.p"),
        ({"target": {"bits": 4}, "options": {"p": 2.0}}, "options.p"),
        ({"target": {"bits": 4}, "options": {"group_size": "256"}}, "options.group_size"),
        ({"target": {"bits": 4}, "options": {"seed": 1.5}}, "options.seed"),
        # The field that is wrong is the one named.
        ({"target": {"bits": -1}, "options": GRID}, "target.bits"),
        ({"target": {"bits": 0}, "options": GRID}, "target.bits"),
        # Duplicates and out-of-range seeds (they used to fail the job later).
        (
            {"target": {"bits": 4}, "options": {"formats": ["native", "native"]}},
            "options.formats",
        ),
        ({"target": {"bits": 4}, "options": {"sign_seed": 2**64}}, "options.sign_seed"),
        ({"target": {"bits": 4}, "options": {"sign_seed": -(2**64)}}, "options.sign_seed"),
        ({"target": {"bits": 4}, "options": {"sign_seed": -1}}, "options.sign_seed"),
        ({"target": {"bits": 4}, "options": {"scale_rule": "median"}}, "options.scale_rule"),
        ({"target": {"bits": 4}, "options": {"seed": 2**63}}, "options.seed"),
        # Exactly one target, the others omitted (not null).
        ({"target": {"bits": 4, "avg_bits": None}}, "target"),
        ({"target": {"bits": None}}, "target"),
        # group_size=1 leaves no feasible avg_bits: the group size is what is wrong.
        ({"target": {"avg_bits": 3}, "options": {"group_size": 1, "p": 1}}, "options.group_size"),
        ({"target": {"avg_bits": 3}, "options": {"group_size": 1}}, "options.group_size"),
    ],
)
def test_sloppy_values_are_422_on_the_right_field(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    body: dict[str, Any],
    field: str,
) -> None:
    r = client.post("/v1/jobs", json={"model": {"id": "tiny"}, **body}, headers=auth)
    problem = assert_problem(r, 422, field)
    assert "[17, 16]" not in problem["detail"], problem
    no_jobs(sessions)


@pytest.mark.parametrize(
    "model",
    [
        {"id": "tiny\n"},
        {"id": "org/model\n"},
        {"id": "org/model", "revision": "main\n"},
        {"id": "org/model\n", "revision": "main"},
    ],
)
def test_trailing_newlines_in_model_refs_are_refused(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session], model: dict[str, str]
) -> None:
    r = client.post("/v1/jobs", json={"model": model, "target": {"bits": 4}}, headers=auth)
    field = "model.revision" if model.get("revision", "").endswith("\n") else "model.id"
    assert_problem(r, 422, field)
    no_jobs(sessions)


def test_unknown_local_model_names_neither_the_folder_nor_other_models(
    client: TestClient, auth: dict[str, str], settings: Settings
) -> None:
    assert settings.models_dir is not None
    (settings.models_dir / "private-customer-model").mkdir()
    r = client.post("/v1/jobs", json={"model": {"id": "nope"}, "target": {"bits": 4}}, headers=auth)
    problem = assert_problem(r, 422, "model.id")
    assert str(settings.models_dir) not in r.text and str(Path.cwd()) not in r.text
    assert "private-customer-model" not in r.text and "tiny" not in r.text
    assert "nope" in problem["detail"]


def test_valid_strict_requests_still_pass(client: TestClient, auth: dict[str, str]) -> None:
    r = client.post(
        "/v1/jobs",
        json={
            "model": {"id": "tiny"},
            "target": {"bits": 4},  # a JSON integer is a number
            "options": {"p": 2, "n": 256, "evaluate": False, "sign_seed": 2**63 - 1, "seed": 0},
        },
        headers=auth,
    )
    assert r.status_code == 202, r.text


@pytest.mark.parametrize(
    ("make", "field", "request_field"),
    [
        (lambda: HiggsConfig(group_size=3), "group_size", "options.group_size"),
        (lambda: HiggsConfig(rotation_block=100), "rotation_block", "options.rotation_block"),
        (lambda: HiggsConfig(dtype="int8"), "dtype", "options.dtype"),
        (lambda: HiggsConfig(p=2, n=3), "n", "options.n"),
        (lambda: HiggsConfig.from_bits(0.5), "bits", "target.bits"),
        (lambda: HiggsConfig.from_dict({"bogus": 1}), None, "options"),
    ],
)
def test_engine_config_errors_carry_their_field(
    make: Any, field: str | None, request_field: str
) -> None:
    """The API names the field from the error's `field`, not from its message."""
    with pytest.raises(InvalidConfigError) as info:
        make()
    assert info.value.field == field
    assert config_error_field(info.value, "bits") == request_field
