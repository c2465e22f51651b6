"""Which webhook URLs the service accepts: http(s) only, and (unless the operator allows it with
HIGGS_WEBHOOK_ALLOW_PRIVATE=1) only hosts whose every address is public, so the service cannot
be used to probe its own network. Checked at submit and again before every delivery."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

MAX_URL_CHARS = 2048

Resolver = Callable[[str, int], list[str]]


class WebhookUrlError(ValueError):
    """The URL is malformed, not http(s), or resolves to an address that is refused."""


def resolve_host(host: str, port: int) -> list[str]:
    """Every address the host resolves to (IPv4 and IPv6)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def refused_reason(address: str) -> str | None:
    """Why an address is not a public one, or None when it is."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for attr, what in (
        ("is_loopback", "loopback"),
        ("is_link_local", "link-local"),
        ("is_private", "private"),
        ("is_multicast", "multicast"),
        ("is_unspecified", "unspecified"),
        ("is_reserved", "reserved"),
    ):
        if getattr(ip, attr):
            return what
    if not ip.is_global:
        return "not globally routable"
    return None


def check_webhook_url(url: str, *, allow_private: bool, resolver: Resolver | None = None) -> str:
    """The URL if it may receive webhooks; WebhookUrlError saying why not."""
    checked_addresses(url, allow_private=allow_private, resolver=resolver)
    return url


@dataclass(frozen=True)
class PinnedRequest:
    """Where to send a delivery: the URL with its host replaced by a vetted address, the Host
    header, and the TLS server name, so the connection goes to the address that was checked
    (a host that resolves elsewhere a moment later cannot redirect it)."""

    url: str
    headers: dict[str, str]
    extensions: dict[str, str]


def pin(url: str, address: str) -> PinnedRequest:
    parts = urlsplit(url)
    host = parts.hostname or ""
    ip = f"[{address}]" if ":" in address else address
    netloc = f"{ip}:{parts.port}" if parts.port else ip
    pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    host_header = parts.netloc.rsplit("@", 1)[-1]
    extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
    return PinnedRequest(pinned, {"Host": host_header}, extensions)


def checked_addresses(
    url: str, *, allow_private: bool, resolver: Resolver | None = None
) -> list[str]:
    """The public addresses url's host resolves to ([] when allow_private: no check, no
    pinning); WebhookUrlError when the URL or any address is refused."""
    if len(url) > MAX_URL_CHARS:
        raise WebhookUrlError(f"webhook_url is {len(url)} characters; at most {MAX_URL_CHARS}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise WebhookUrlError(f"webhook_url {url[:200]!r} is not a valid URL: {e}") from e
    if parts.scheme not in ("http", "https"):
        raise WebhookUrlError(
            f"webhook_url {url[:200]!r} must be an http:// or https:// URL"
            + (f" (got scheme {parts.scheme!r})" if parts.scheme else "")
        )
    host = parts.hostname
    if not host:
        raise WebhookUrlError(f"webhook_url {url[:200]!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise WebhookUrlError(f"webhook_url {url[:200]!r} must not carry a user name or password")
    if parts.fragment:
        raise WebhookUrlError(f"webhook_url {url[:200]!r} must not have a #fragment")
    if allow_private:
        return []
    try:
        addresses = (resolver or resolve_host)(
            host, port or (443 if parts.scheme == "https" else 80)
        )
    except (OSError, UnicodeError) as e:
        raise WebhookUrlError(f"webhook_url host {host!r} does not resolve: {e}") from e
    if not addresses:
        raise WebhookUrlError(f"webhook_url host {host!r} resolves to no address")
    for address in addresses:
        reason = refused_reason(address)
        if reason is not None:
            raise WebhookUrlError(
                f"webhook_url host {host!r} resolves to {address}, a {reason} address; "
                "webhooks go to public addresses only (an operator may allow private ones "
                "with HIGGS_WEBHOOK_ALLOW_PRIVATE=1)"
            )
    return addresses
