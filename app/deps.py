"""FastAPI dependencies, injected through Annotated aliases (SettingsDep, SessionDep, CurrentKey)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from app.db.models import ApiKey
from app.errors import UnauthorizedError
from app.keys.service import authenticate
from app.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="an API key from `higgs keys create NAME`")


def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_sessions(request: Request) -> sessionmaker[Session]:
    sessions: sessionmaker[Session] = request.app.state.sessions
    return sessions


def get_session(request: Request) -> Iterator[Session]:
    with get_sessions(request)() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
SessionDep = Annotated[Session, Depends(get_session)]


def current_key(
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> ApiKey:
    if credentials is None:
        raise UnauthorizedError(
            "missing or non-Bearer Authorization header; send 'Authorization: Bearer <api key>'"
        )
    return authenticate(session, f"{credentials.scheme} {credentials.credentials}")


CurrentKey = Annotated[ApiKey, Depends(current_key)]
