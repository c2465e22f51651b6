"""Per-key Hub tokens in the API: set, read and cleared through /v1/keys/me/hub-token, stored
encrypted (never in the clear, never answered), rotated by listing secrets, and chosen per job
(the key's own, else the service's only where the operator allows it)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.db.models import ApiKey
from app.keys.hub_token import HubTokens, HubTokenUnreadableError, set_hub_token
from app.keys.service import create_key
from app.main import create_app
from app.settings import Settings
from tests.fixtures import assert_problem

TOKEN = "hf_abcdefghijklmnopqrstuvwxyz012345"


@pytest.fixture
def secret_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"hub_token_secret": "first secret"})


def _stored(sessions: sessionmaker[Session]) -> list[str | None]:
    with sessions() as s:
        return list(s.scalars(select(ApiKey.hub_token)))


def test_set_read_clear_never_echoes_and_stores_no_plaintext(
    secret_settings: Settings, sessions: sessionmaker[Session], auth: dict[str, str]
) -> None:
    with TestClient(create_app(secret_settings)) as c:
        assert c.get("/v1/keys/me/hub-token", headers=auth).json()["set"] is False
        r = c.put("/v1/keys/me/hub-token", json={"token": TOKEN}, headers=auth)
        assert r.status_code == 200 and r.json()["set"] is True and r.json()["set_at"]
        assert TOKEN not in r.text
        got = c.get("/v1/keys/me/hub-token", headers=auth)
        assert got.json()["set"] is True and TOKEN not in got.text
        stored = _stored(sessions)
        assert stored and stored[0] and TOKEN not in stored[0]
        # No other answer carries it either (the OpenAPI document, the key's jobs).
        assert TOKEN not in c.get("/openapi.json").text
        r = c.delete("/v1/keys/me/hub-token", headers=auth)
        assert r.json() == {**r.json(), "set": False, "set_at": None}
        assert _stored(sessions) == [None]


@pytest.mark.parametrize("bad", ["hf bad token", "short", "hf_\ttab_in_the_middle", ""])
def test_a_bad_token_is_a_422_that_never_repeats_it(
    secret_settings: Settings, auth: dict[str, str], bad: str
) -> None:
    with TestClient(create_app(secret_settings)) as c:
        r = c.put("/v1/keys/me/hub-token", json={"token": bad}, headers=auth)
        body = assert_problem(r, 422, "token")
        if bad:
            assert bad not in json.dumps(body)


def test_without_a_secret_no_token_is_stored(
    client: TestClient, sessions: sessionmaker[Session], auth: dict[str, str]
) -> None:
    body = assert_problem(
        client.put("/v1/keys/me/hub-token", json={"token": TOKEN}, headers=auth), 422, "token"
    )
    assert body["code"] == "not_supported" and "HIGGS_HUB_TOKEN_SECRET" in body["detail"]
    assert _stored(sessions) == [None]


def test_which_token_a_job_uses(secret_settings: Settings, sessions: sessionmaker[Session]) -> None:
    with sessions() as s:
        own, _ = create_key(s, "own")
        plain, _ = create_key(s, "plain")
        allowed, _ = create_key(s, "allowed")
        set_hub_token(s, own.id, TOKEN, secret_settings)
    service = "hf_service_token_value"
    rules: dict[str, Any] = {"hf_token": service, "hf_token_keys": f" {allowed.id} , x"}
    tokens = HubTokens.from_settings(secret_settings.model_copy(update=rules))
    with sessions() as s:
        assert tokens.for_key(s, own.id) == TOKEN  # its own, even where the service's is allowed
        assert tokens.for_key(s, plain.id) is None  # anonymous: not listed
        assert tokens.for_key(s, allowed.id) == service
        assert tokens.for_key(s, None) is None
    every = HubTokens.from_settings(
        secret_settings.model_copy(update={**rules, "hf_token_keys": "*"})
    )
    with sessions() as s:
        assert every.for_key(s, plain.id) == service
    # The default: the service token for nobody.
    with sessions() as s:
        assert (
            HubTokens.from_settings(
                secret_settings.model_copy(update={"hf_token": service})
            ).for_key(s, plain.id)
            is None
        )


def test_secrets_rotate_and_a_lost_secret_is_said(
    secret_settings: Settings, sessions: sessionmaker[Session]
) -> None:
    with sessions() as s:
        row, _ = create_key(s, "k")
        set_hub_token(s, row.id, TOKEN, secret_settings)
    rotated = secret_settings.model_copy(update={"hub_token_secret": "new secret,first secret"})
    with sessions() as s:
        assert HubTokens.from_settings(rotated).for_key(s, row.id) == TOKEN
    lost = secret_settings.model_copy(update={"hub_token_secret": "new secret"})
    with sessions() as s, pytest.raises(HubTokenUnreadableError, match="set the token again"):
        HubTokens.from_settings(lost).for_key(s, row.id)
