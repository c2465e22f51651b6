"""HTTP for artifacts: file list, ranged single-file download, streamed tar archive."""

from __future__ import annotations

import mimetypes
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import StreamingResponse
from starlette.responses import Response

from app.artifacts import service
from app.artifacts.download import (
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
from app.deps import CurrentKey, SessionsDep
from app.jobs.routes import ERRORS, PROBLEM
from app.jobs.schemas import ArtifactOut, Format

router = APIRouter(prefix="/v1/jobs/{job_id}/artifacts", tags=["artifacts"])


@router.get(
    "/{format}", response_model=ArtifactOut, responses=ERRORS, summary="Files of an artifact"
)
def list_artifact(
    job_id: str, format: Format, sessions: SessionsDep, key: CurrentKey
) -> ArtifactOut:
    with sessions() as session:
        art = service.get_artifact(session, key, job_id, format)
    return service.artifact_view(art)


@router.get(
    "/{format}/files/{path:path}",
    responses={**ERRORS, 206: {"description": "partial content"}, 416: PROBLEM},
    summary="One file, streamed; Range (206), ETag and sha256 digest headers",
)
def download_file(
    job_id: str,
    format: Format,
    path: str,
    sessions: SessionsDep,
    key: CurrentKey,
    range_: Annotated[str | None, Header(alias="Range")] = None,
    if_range: Annotated[str | None, Header(alias="If-Range")] = None,
    if_none_match: Annotated[str | None, Header(alias="If-None-Match")] = None,
) -> Response:
    with sessions() as session:  # closed before the file is sent
        art = service.get_artifact(session, key, job_id, format)
    row, full = service.resolve_file(art, path)
    headers = {**digest_headers(row.sha256), "Accept-Ranges": "bytes"}
    etag = headers["ETag"]
    if none_match(if_none_match, etag):
        return Response(status_code=304, headers=headers)
    size = row.bytes
    # If-Range with another validator: the client's partial copy is stale, send it all.
    rng = parse_range(range_, size) if if_range_matches(if_range, etag) else None
    media = mimetypes.guess_type(row.path)[0] or "application/octet-stream"
    if rng is None:
        return FileSliceResponse(full, 0, size, status_code=200, headers=headers, media_type=media)
    start, end = rng
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    return FileSliceResponse(full, start, end, status_code=206, headers=headers, media_type=media)


@router.get(
    "/{format}/archive",
    responses={**ERRORS, 200: {"content": {"application/x-tar": {}}}},
    summary="The whole artifact as one streamed tar",
)
def download_archive(
    job_id: str,
    format: Format,
    request: Request,
    sessions: SessionsDep,
    key: CurrentKey,
    if_none_match: Annotated[str | None, Header(alias="If-None-Match")] = None,
) -> Response:
    with sessions() as session:  # closed before the archive is sent
        art = service.get_artifact(session, key, job_id, format)
    members = []
    for f in art.files:
        row, full = service.resolve_file(art, f.path)
        members.append(TarMember(name=f"{art.format}/{row.path}", path=full, size=row.bytes))
    mtime = art.created_at.timestamp()
    etag = f'"{art.sha256}"'
    headers = {
        "Content-Length": str(tar_size(members, mtime)),
        "Content-Disposition": f'attachment; filename="{job_id}-{art.format}.tar"',
        "ETag": etag,
    }
    if none_match(if_none_match, etag):
        del headers["Content-Length"]
        return Response(status_code=304, headers=headers)
    if is_head(request.scope):  # headers only: the archive is not built
        return Response(status_code=200, headers=headers, media_type="application/x-tar")
    return StreamingResponse(
        tar_stream(members, mtime), media_type="application/x-tar", headers=headers
    )
