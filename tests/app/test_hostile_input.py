"""Hostile and sloppy input: every value the API once took and should not have is now a 422
naming the right field, and nothing is stored."""

from __future__ import annotations

import base64
import json
import random
import string
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.db.models import Job
from app.errors import UnauthorizedError
from app.jobs.service import config_error_field
from app.links import check_token
from app.main import create_app
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


# ---------------------------------------------------------------- ids, cursors and tokens

# Every route with an id in its path, and the field a bad id is named by.
PATH_ID_ROUTES = [
    ("GET", "/v1/jobs/{id}", "job_id"),
    ("POST", "/v1/jobs/{id}/cancel", "job_id"),
    ("GET", "/v1/jobs/{id}/layers", "job_id"),
    ("GET", "/v1/jobs/{id}/report", "job_id"),
    ("GET", "/v1/jobs/{id}/events", "job_id"),
    ("GET", "/v1/jobs/{id}/webhooks", "job_id"),
    ("GET", "/v1/jobs/{id}/artifacts/native", "job_id"),
    ("GET", "/v1/jobs/{id}/artifacts/native/files/model.safetensors", "job_id"),
    ("GET", "/v1/jobs/x/artifacts/native/files/{id}", "path"),
    ("GET", "/v1/jobs/x/artifacts/native/files/dir/{id}", "path"),
    ("POST", "/v1/jobs/{id}/artifacts/native/link", "job_id"),
    ("GET", "/v1/jobs/{id}/artifacts/native/archive", "job_id"),
    ("GET", "/v1/jobs/{id}/artifacts/native/archive?token=abc.def", "job_id"),
    ("GET", "/v1/calibrations/{id}", "calibration_id"),
]
CONTROL_CHARS = [chr(c) for c in range(0x20)] + ["\x7f"]


def _fuzzed_ids(seed: int, count: int) -> list[str]:
    """Ids with control characters (NUL always among them) at the start, middle and end."""
    rng = random.Random(seed)
    ids = ["\x00", "x\x00", "\x00x", "0a4c1e4e-0000-4000-8000-00000000000\x00", "x\x7f"]
    while len(ids) < count:
        base = "".join(rng.choice(string.ascii_letters + string.digits + "-") for _ in range(8))
        at = rng.randrange(len(base) + 1)
        ids.append(base[:at] + rng.choice(CONTROL_CHARS) + base[at:])
    return ids


def test_control_characters_in_path_ids_are_422_on_every_route(
    settings: Settings, auth: dict[str, str]
) -> None:
    """A NUL (PostgreSQL refuses it in text) or any other control character in an id is a 422
    naming the parameter, on SQLite and PostgreSQL alike; never a 500."""
    unlimited = settings.model_copy(update={"rate_limit_per_s": 0})
    with TestClient(create_app(unlimited)) as client:
        for raw in _fuzzed_ids(seed=20261201, count=24):
            for method, template, field in PATH_ID_ROUTES:
                url = template.replace("{id}", quote(raw, safe=""))
                r = client.request(method, url, headers=auth)
                problem = assert_problem(r, 422, field)
                assert "control characters" in problem["detail"], problem
        # Without control characters an unknown id is still a plain 404.
        assert_problem(client.get("/v1/jobs/x", headers=auth), 404)
        assert_problem(client.get("/v1/calibrations/x%20y", headers=auth), 404)


def _cursor(created: str, job_id: Any) -> str:
    raw = json.dumps([created, job_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.mark.parametrize(
    ("created", "job_id"),
    [
        ("9999-12-31T23:59:59-14:00", "x"),  # past year 9999 in UTC
        ("0001-01-01T00:00:00+14:00", "x"),  # before year 1 in UTC
        ("2026-01-01T00:00:00+00:00", "x\x00"),
        ("2026-01-01T00:00:00+00:00", "x\n"),
        ("2026-01-01T00:00:00+00:00", 7),
        ("2026-01-01T00:00:00", "x"),  # no time zone
    ],
)
def test_forged_cursors_are_422_on_after(
    client: TestClient, auth: dict[str, str], created: str, job_id: Any
) -> None:
    r = client.get("/v1/jobs", params={"after": _cursor(created, job_id)}, headers=auth)
    assert_problem(r, 422, "after")


def test_cursors_at_the_edges_of_the_calendar_still_work(
    client: TestClient, auth: dict[str, str]
) -> None:
    for created in ("9999-12-31T23:59:59.999999+00:00", "0001-01-01T00:00:00-14:00"):
        r = client.get("/v1/jobs", params={"after": _cursor(created, "x")}, headers=auth)
        assert r.status_code == 200 and r.json()["data"] == [], r.text


def _token(payload: bytes) -> str:
    return base64.urlsafe_b64encode(payload).decode().rstrip("=") + ".AAAA"


@pytest.mark.parametrize(
    "payload",
    [
        b'{"k":"a","j":"x","f":"native","e":1e999}',  # infinity
        b'{"k":"a","j":"x","f":"native","e":-1e999}',
        b'{"k":"a","j":"x","f":"native","e":NaN}',
        b'{"k":"a\\u0000","j":"x","f":"native","e":1}',  # NUL in the key id
        b'{"k":"a","j":"x\\u0000","f":"native","e":1}',
        b'{"k":["a"],"j":"x","f":"native","e":1}',
        b'{"k":"a","j":"x","f":"native","e":' + b"9" * 600 + b"}",
        b"[" * 600 + b"]" * 60,  # nested as deep as the length limit allows
        b'{"k":' * 110 + b"1" + b"}" * 110,
        b'"just a string"',
    ],
)
def test_forged_link_tokens_are_401(
    client: TestClient, auth: dict[str, str], payload: bytes
) -> None:
    """A forged ?token= is refused like any other bad token (401), whatever its JSON holds."""
    r = client.get("/v1/jobs/x/artifacts/native/archive", params={"token": _token(payload)})
    assert_problem(r, 401)


def test_deeply_nested_token_payloads_are_not_link_tokens() -> None:
    """Past the length limit too (the route checks it first), nesting is refused, not a crash."""
    for payload in (b"[" * 100_000, b'{"k":' * 50_000):
        with pytest.raises(UnauthorizedError):
            check_token(cast(Session, None), _token(payload), "x", "native", None)


def test_oversized_link_tokens_are_refused(client: TestClient) -> None:
    r = client.get("/v1/jobs/x/artifacts/native/archive", params={"token": _token(b"[" * 20000)})
    assert_problem(r, 422, "token")


@pytest.mark.parametrize(
    "url", ["http://hooks.example/\x00", "http://hooks.exa\x00mple/", "http://hooks.example/a\nb"]
)
def test_control_characters_in_a_webhook_url_are_422(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session], url: str
) -> None:
    body = {"model": {"id": "tiny"}, "target": {"bits": 4}, "webhook_url": url}
    problem = assert_problem(client.post("/v1/jobs", json=body, headers=auth), 422, "webhook_url")
    assert "control characters" in problem["detail"]
    no_jobs(sessions)
