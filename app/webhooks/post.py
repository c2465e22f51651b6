"""One webhook POST under a total deadline.

Per-operation timeouts (connect, each read, each write) do not bound a delivery: a receiver that
answers one byte every few seconds never trips a read timeout. Here every socket operation of
the request waits at most for what is left of one wall-clock deadline, so the whole POST (connect,
TLS, request, status line, headers, the start of the answer) ends by then. Redirects are never
followed, and at most `max_answer_bytes` of the answer's body are read (the rest is dropped with
the connection): only the status counts.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterable, Mapping

import httpcore
import httpx

# What a failed POST raises (and the dispatcher records): no connection, a timeout or the
# deadline, a broken answer, a URL httpcore cannot use.
POST_ERRORS = (
    httpcore.TimeoutException,
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
    httpx.InvalidURL,
    ssl.SSLError,
    OSError,
)


class DeliveryTimeout(httpcore.ReadTimeout):
    """The delivery ran into its total deadline."""


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream, deadline: float, total_s: float) -> None:
        self._stream = stream
        self._deadline = deadline
        self._total_s = total_s

    def _left(self, timeout: float | None) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise DeliveryTimeout(f"no complete answer within {self._total_s:g} s")
        return left if timeout is None else min(timeout, left)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            return self._stream.read(max_bytes, self._left(timeout))
        except httpcore.ReadTimeout:
            self._left(None)  # the deadline, when that is what stopped the read
            raise

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, self._left(timeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        tls = self._stream.start_tls(ssl_context, server_hostname, self._left(timeout))
        return _DeadlineStream(tls, self._deadline, self._total_s)

    def get_extra_info(self, info: str) -> object:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's blocking sockets, each operation bounded by what is left of the deadline."""

    def __init__(self, deadline: float, total_s: float) -> None:
        self._backend = httpcore.SyncBackend()
        self._deadline = deadline
        self._total_s = total_s

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise DeliveryTimeout(f"no connection within {self._total_s:g} s")
        left = left if timeout is None else min(timeout, left)
        stream = self._backend.connect_tcp(host, port, left, local_address, socket_options)
        return _DeadlineStream(stream, self._deadline, self._total_s)

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:  # pragma: no cover - webhooks go to TCP addresses
        raise httpcore.UnsupportedProtocol("webhooks are not sent to unix sockets")

    def sleep(self, seconds: float) -> None:  # pragma: no cover - no retries are configured
        time.sleep(seconds)


def post(
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    total_s: float,
    max_answer_bytes: int,
    sni_hostname: str | None = None,
) -> int:
    """POST body to url and return the answer's status; raises one of POST_ERRORS. The Host
    header is the URL's unless `headers` names one (a pinned address keeps the original)."""
    deadline = time.monotonic() + total_s
    u = httpx.URL(url)
    target = httpcore.URL(scheme=u.raw_scheme, host=u.raw_host, port=u.port, target=u.raw_path)
    sent = {"Host": u.netloc.decode("ascii"), **headers, "Content-Length": str(len(body))}
    extensions: dict[str, object] = {
        "timeout": {"connect": total_s, "read": total_s, "write": total_s, "pool": total_s}
    }
    if sni_hostname:
        extensions["sni_hostname"] = sni_hostname
    backend = _DeadlineBackend(deadline, total_s)
    with (
        httpcore.ConnectionPool(max_connections=1, network_backend=backend) as pool,
        pool.stream(
            "POST", target, headers=list(sent.items()), content=body, extensions=extensions
        ) as answer,
    ):
        status = answer.status
        read = 0
        try:
            for chunk in answer.iter_stream():
                read += len(chunk)
                if read >= max_answer_bytes:
                    break
        except POST_ERRORS:  # the status is in: the rest of the answer does not matter
            pass
    return status
