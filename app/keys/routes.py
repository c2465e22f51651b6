"""HTTP for the caller's own key: its Hugging Face Hub token (set, clear, whether one is set;
never the token itself)."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from app.deps import CurrentKey, SessionsDep, SettingsDep
from app.keys import hub_token
from app.openapi import AUTHENTICATED, problems

router = APIRouter(prefix="/v1/keys/me", tags=["keys"])


class HubTokenIn(BaseModel):
    # Checked by app.keys.hub_token, whose messages never repeat the value (request
    # validation errors quote what they got).
    model_config = ConfigDict(extra="forbid", strict=True)

    token: str = Field(
        description="a Hugging Face access token (hf_...): 8..512 printable ASCII characters "
        "without spaces",
        json_schema_extra={"minLength": 8, "maxLength": 512, "pattern": r"^[\x21-\x7e]+$"},
    )


class HubTokenOut(BaseModel):
    set: bool = Field(description="whether this key has a Hub token of its own")
    set_at: datetime | None
    uses: str = Field(
        default="this key's jobs only: the worker's Hub downloads and the submit-time "
        "config.json check",
    )


def _out(status: hub_token.HubTokenStatus) -> HubTokenOut:
    return HubTokenOut(set=status.set, set_at=status.set_at)


@router.get(
    "/hub-token",
    response_model=HubTokenOut,
    responses=problems(*AUTHENTICATED),
    summary="Whether the caller's key has a Hub token (never the token)",
)
def get_hub_token(sessions: SessionsDep, key: CurrentKey) -> HubTokenOut:
    with sessions() as session:
        return _out(hub_token.hub_token_status(session, key.id))


@router.put(
    "/hub-token",
    response_model=HubTokenOut,
    responses=problems(*AUTHENTICATED, 400, 413, 422),
    summary="Set the caller's Hub token (stored encrypted; 422 when the service stores none)",
)
def put_hub_token(
    body: HubTokenIn, sessions: SessionsDep, settings: SettingsDep, key: CurrentKey
) -> HubTokenOut:
    with sessions() as session:
        return _out(hub_token.set_hub_token(session, key.id, body.token, settings))


@router.delete(
    "/hub-token",
    response_model=HubTokenOut,
    responses=problems(*AUTHENTICATED),
    summary="Remove the caller's Hub token",
)
def delete_hub_token(sessions: SessionsDep, key: CurrentKey) -> HubTokenOut:
    with sessions() as session:
        return _out(hub_token.clear_hub_token(session, key.id))
