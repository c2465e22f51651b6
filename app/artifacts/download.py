"""Streaming responses for artifact files (single byte ranges) and whole-artifact tar archives."""

from __future__ import annotations

import base64
import re
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
from starlette.concurrency import iterate_in_threadpool
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.errors import RangeNotSatisfiableError

CHUNK = 256 * 1024
# The unit is case-insensitive (RFC 9110 section 14.1).
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$", re.IGNORECASE)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end_exclusive) of a single `Range: bytes=...` header; None = send everything.

    Several ranges or another unit are ignored (RFC 9110 allows a full 200 response); a bytes
    range that is malformed or starts past the end is RangeNotSatisfiableError (416).
    """
    if header is None:
        return None
    header = header.strip()
    if not header.lower().startswith("bytes=") or "," in header:
        return None
    m = _RANGE.match(header.replace(" ", ""))
    if m is None or (not m.group(1) and not m.group(2)):
        raise RangeNotSatisfiableError(f"Range {header!r} is not a valid byte range", size=size)
    first, last = m.group(1), m.group(2)
    if not first:  # suffix: the last N bytes
        n = int(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiableError(
                f"Range {header!r} selects no bytes of {size}", size=size
            )
        return max(0, size - n), size
    start = int(first)
    end = size if not last else min(int(last) + 1, size)
    if start >= size or (last and int(last) < start):
        raise RangeNotSatisfiableError(
            f"Range {header!r} is outside the file ({size} bytes)", size=size
        )
    return start, end


def _opaque(tag: str) -> str:
    tag = tag.strip()
    return tag[2:] if tag[:2] in ("W/", "w/") else tag


def none_match(header: str | None, etag: str) -> bool:
    """If-None-Match matches: `*`, or any listed tag equal to etag by the weak comparison
    (RFC 9110 section 13.1.2: W/ prefixes ignored)."""
    if header is None:
        return False
    tags = [t for t in header.split(",") if t.strip()]
    return any(t.strip() == "*" or _opaque(t) == _opaque(etag) for t in tags)


def if_range_matches(header: str | None, etag: str) -> bool:
    """If-Range allows the partial answer: absent, or a strong tag equal to etag (a weak tag
    or a date never matches: the whole representation is sent)."""
    if header is None:
        return True
    return header.strip() == etag


def digest_headers(sha256_hex: str) -> dict[str, str]:
    b64 = base64.b64encode(bytes.fromhex(sha256_hex)).decode()
    return {
        "ETag": f'"{sha256_hex}"',
        "Repr-Digest": f"sha-256=:{b64}:",
        "X-Checksum-Sha256": sha256_hex,
    }


def is_head(scope: Scope) -> bool:
    """A HEAD request (app.main.HeadOptionsMiddleware routes HEAD as GET and marks it)."""
    return scope.get("method") == "HEAD" or bool(scope.get("higgs.head"))


class FileSliceResponse(Response):
    """Bytes [start, end) of a file, streamed in chunks; HEAD sends the headers only."""

    def __init__(
        self,
        path: Path,
        start: int,
        end: int,
        *,
        status_code: int,
        headers: dict[str, str],
        media_type: str,
    ) -> None:
        self.path, self.start, self.end = path, start, end
        super().__init__(
            content=None,
            status_code=status_code,
            headers={**headers, "Content-Length": str(end - start)},
            media_type=media_type,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        if is_head(scope) or self.end <= self.start:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        remaining = self.end - self.start
        async with await anyio.open_file(self.path, "rb") as f:
            await f.seek(self.start)
            while remaining > 0:
                chunk = await f.read(min(CHUNK, remaining))
                if not chunk:  # the file shrank under us: stop rather than hang
                    break
                remaining -= len(chunk)
                await send(
                    {"type": "http.response.body", "body": chunk, "more_body": remaining > 0}
                )
        if remaining > 0:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class ChunksResponse(Response):
    """A body of known length from a chunk iterator (an artifact store's ranged read), pulled
    in a worker thread; HEAD sends the headers only."""

    def __init__(
        self,
        chunks: Iterator[bytes],
        length: int,
        *,
        status_code: int,
        headers: dict[str, str],
        media_type: str,
    ) -> None:
        self.chunks = chunks
        super().__init__(
            content=None,
            status_code=status_code,
            headers={**headers, "Content-Length": str(length)},
            media_type=media_type,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            if not is_head(scope):
                async for chunk in iterate_in_threadpool(self.chunks):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            close = getattr(self.chunks, "close", None)
            if close is not None:
                await anyio.to_thread.run_sync(close)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@dataclass(frozen=True)
class TarMember:
    name: str  # path inside the archive
    path: Path | None  # file on disk, or None with `read`
    size: int
    # The member's bytes from elsewhere (an artifact store), opened when the member is reached.
    read: Callable[[], Iterator[bytes]] | None = None


def _header(member: TarMember, mtime: float) -> bytes:
    info = tarfile.TarInfo(member.name)
    info.size, info.mtime, info.mode = member.size, int(mtime), 0o644
    return info.tobuf(format=tarfile.PAX_FORMAT)


def tar_size(members: Sequence[TarMember], mtime: float) -> int:
    """Exact byte length of tar_stream(members): known up front, so Content-Length is set."""
    total = 0
    for m in members:
        total += len(_header(m, mtime)) + -(-m.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    return total + 2 * tarfile.BLOCKSIZE


def _member_chunks(m: TarMember) -> Iterator[bytes]:
    if m.read is not None:
        yield from m.read()
        return
    if m.path is None:
        raise ValueError(f"tar member {m.name!r} has neither a path nor a reader")
    with m.path.open("rb") as f:
        remaining = m.size
        while remaining > 0:
            chunk = f.read(min(CHUNK, remaining))
            if not chunk:
                return
            remaining -= len(chunk)
            yield chunk


def tar_stream(members: Sequence[TarMember], mtime: float) -> Iterator[bytes]:
    """A POSIX (pax) tar of the members, produced chunk by chunk without a temporary file."""
    for m in members:
        yield _header(m, mtime)
        written = 0
        for chunk in _member_chunks(m):
            written += len(chunk)
            if written > m.size:
                raise OSError(f"{m.name} is longer than its recorded {m.size} bytes")
            yield chunk
        if written < m.size:
            raise OSError(f"{m.name} is shorter than its recorded {m.size} bytes")
        pad = -m.size % tarfile.BLOCKSIZE
        if pad:
            yield b"\0" * pad
    yield b"\0" * (2 * tarfile.BLOCKSIZE)
