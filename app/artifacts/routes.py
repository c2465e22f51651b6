"""HTTP for artifacts: file list, ranged single-file download, streamed tar archive."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from app.artifacts import service
from app.artifacts.download import (
    ChunksResponse,
    FileSliceResponse,
    TarMember,
    digest_headers,
    if_range_matches,
    is_head,
    none_match,
    parse_range,
    tar_size,
    tar_stream,
)
from app.artifacts.store import (
    ArtifactStore,
    LocalStore,
    S3Store,
    StoreObjectMissingError,
    store_for_uri,
)
from app.db.models import ArtifactFile
from app.deps import CurrentKey, SessionsDep, SettingsDep, current_key
from app.jobs.schemas import ArtifactOut, Format
from app.keys.service import AuthKey
from app.limits import RateLimiter
from app.links import MAX_TOKEN_CHARS, check_token, make_token
from app.openapi import AUTHENTICATED, problems
from app.params import FilePath, JobId

OCTETS = "application/octet-stream"
BINARY = {"type": "string", "format": "binary"}
router = APIRouter(prefix="/v1/jobs/{job_id}/artifacts", tags=["artifacts"])


@router.get(
    "/{format}",
    response_model=ArtifactOut,
    responses=problems(*AUTHENTICATED, 404, 422),
    summary="Files of an artifact",
)
def get_artifact(
    job_id: JobId, format: Format, sessions: SessionsDep, key: CurrentKey
) -> ArtifactOut:
    with sessions() as session:
        art = service.get_artifact(session, key, job_id, format)
    return service.artifact_view(art)


@dataclass(frozen=True)
class Conditions:
    """A file download's conditional request headers: Range, If-Range, If-None-Match."""

    range: str | None
    if_range: str | None
    if_none_match: str | None


def _conditions(
    range_: Annotated[str | None, Header(alias="Range")] = None,
    if_range: Annotated[str | None, Header(alias="If-Range")] = None,
    if_none_match: Annotated[str | None, Header(alias="If-None-Match")] = None,
) -> Conditions:
    return Conditions(range_, if_range, if_none_match)


ConditionsDep = Annotated[Conditions, Depends(_conditions)]


@router.get(
    "/{format}/files/{path:path}",
    response_class=Response,
    responses={
        **problems(*AUTHENTICATED, 304, 400, 404, 416, 422, 500),
        200: {
            "description": "the file",
            "content": {OCTETS: {"schema": BINARY}},
        },
        206: {
            "description": "the requested byte range",
            "content": {OCTETS: {"schema": BINARY}},
        },
        307: {"description": "a presigned store URL (HIGGS_ARTIFACTS_REDIRECT=1, S3 store)"},
    },
    summary="One file, streamed from the store; Range (206), ETag and sha256 digest headers",
)
def download_file(
    job_id: JobId,
    format: Format,
    path: FilePath,
    request: Request,
    sessions: SessionsDep,
    settings: SettingsDep,
    key: CurrentKey,
    conditions: ConditionsDep,
) -> Response:
    with sessions() as session:  # closed before the file is sent
        art = service.get_artifact(session, key, job_id, format)
    row = service.resolve_file(art, path)
    store = store_for_uri(settings, art.uri)
    headers = {**digest_headers(row.sha256), "Accept-Ranges": "bytes"}
    etag = headers["ETag"]
    if none_match(conditions.if_none_match, etag):
        return Response(status_code=304, headers=headers)
    size = row.bytes
    head = is_head(request.scope)
    if settings.artifacts_redirect and isinstance(store, S3Store) and not head:
        # The store answers Range itself; the client checks the digest headers sent here.
        url = store.presigned_url(art.uri, row.path, settings.artifacts_redirect_ttl_s)
        if url is not None:
            return Response(status_code=307, headers={**headers, "Location": url})
    # If-Range with another validator: the client's partial copy is stale, send it all.
    rng = (
        parse_range(conditions.range, size) if if_range_matches(conditions.if_range, etag) else None
    )
    # Artifact files are bytes to save, whatever their name: one content type, as documented.
    media = "application/octet-stream"
    start, end = (0, size) if rng is None else rng
    status = 200 if rng is None else 206
    if rng is not None:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    try:
        if isinstance(store, LocalStore):
            full = store.local_file(art.uri, row.path)
            return FileSliceResponse(
                full, start, end, status_code=status, headers=headers, media_type=media
            )
        if head:  # the object must exist; its bytes are not read
            store.stat(art.uri, row.path)
            chunks: Iterator[bytes] = iter(())
        else:
            chunks = store.open_range(art.uri, row.path, start, end)
    except StoreObjectMissingError as exc:
        raise service.missing(art, row.path) from exc
    return ChunksResponse(
        chunks, end - start, status_code=status, headers=headers, media_type=media
    )


class LinkOut(BaseModel):
    url: str
    expires_at: int


@router.post(
    "/{format}/link",
    response_model=LinkOut,
    responses=problems(*AUTHENTICATED, 404, 422),
    summary="A short-lived signed URL of the archive, usable without an Authorization header",
)
def archive_link(
    job_id: JobId, format: Format, sessions: SessionsDep, settings: SettingsDep, key: CurrentKey
) -> LinkOut:
    with sessions() as session:
        service.get_artifact(session, key, job_id, format)  # 404 unless it exists now
        token, expires = make_token(
            session, key.id, job_id, format, settings.link_ttl_s, settings.link_secret
        )
    return LinkOut(
        url=f"/v1/jobs/{job_id}/artifacts/{format}/archive?token={token}", expires_at=expires
    )


_bearer = HTTPBearer(auto_error=False)


async def _archive_key(
    request: Request,
    job_id: JobId,
    format: Format,
    sessions: SessionsDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    token: Annotated[
        str | None,
        Query(
            description="a signed link token from POST .../{format}/link",
            max_length=MAX_TOKEN_CHARS,
        ),
    ] = None,
) -> AuthKey:
    """The API key (Authorization header, as everywhere) or a signed link's key (?token=)."""
    if credentials is not None or token is None:
        return await current_key(request, credentials)

    def load() -> AuthKey:
        with sessions() as session:
            return AuthKey.of(check_token(session, token, job_id, format, settings.link_secret))

    key = await run_in_threadpool(load)
    limiter: RateLimiter = request.app.state.rate_limiter
    await limiter.acheck(key.id)
    return key


@router.get(
    "/{format}/archive",
    response_class=Response,
    responses={
        **problems(*AUTHENTICATED, 304, 404, 422, 500),
        200: {
            "description": "a POSIX tar",
            "content": {"application/x-tar": {"schema": BINARY}},
        },
    },
    summary="The whole artifact as one streamed tar (API key, or ?token= of a signed link)",
)
def download_archive(
    job_id: JobId,
    format: Format,
    request: Request,
    sessions: SessionsDep,
    settings: SettingsDep,
    key: Annotated[AuthKey, Depends(_archive_key)],
    if_none_match: Annotated[str | None, Header(alias="If-None-Match")] = None,
) -> Response:
    with sessions() as session:  # closed before the archive is sent
        art = service.get_artifact(session, key, job_id, format)
    store = store_for_uri(settings, art.uri)
    members = []
    for f in art.files:
        row = service.resolve_file(art, f.path)
        name = f"{art.format}/{row.path}"
        try:
            if isinstance(store, LocalStore):
                full = store.local_file(art.uri, row.path)
                members.append(TarMember(name=name, path=full, size=row.bytes))
            else:
                # Every object is there before the archive starts (a missing one is a 500 now,
                # not a broken stream later; an unreachable store a 503).
                if not is_head(request.scope):
                    store.stat(art.uri, row.path)
                members.append(
                    TarMember(
                        name=name, path=None, size=row.bytes, read=_reader(store, art.uri, row)
                    )
                )
        except StoreObjectMissingError as exc:
            raise service.missing(art, row.path) from exc
    mtime = art.created_at.timestamp()
    etag = f'"{art.sha256}"'
    headers = {
        "Content-Length": str(tar_size(members, mtime)),
        "Content-Disposition": f'attachment; filename="{job_id}-{art.format}.tar"',
        "ETag": etag,
        # The URL may carry a link token: keep it out of Referer headers and caches.
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "private, no-store",
    }
    if none_match(if_none_match, etag):
        del headers["Content-Length"]
        return Response(status_code=304, headers=headers)
    if is_head(request.scope):  # headers only: the archive is not built
        return Response(status_code=200, headers=headers, media_type="application/x-tar")
    return StreamingResponse(
        tar_stream(members, mtime), media_type="application/x-tar", headers=headers
    )


def _reader(store: ArtifactStore, uri: str, row: ArtifactFile) -> Callable[[], Iterator[bytes]]:
    return lambda: store.open_range(uri, row.path, 0, row.bytes)
