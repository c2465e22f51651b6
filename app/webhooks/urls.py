"""Which webhook URLs the service accepts: http(s) only, and (unless the operator allows it with
HIGGS_WEBHOOK_ALLOW_PRIVATE=1) only hosts whose every address is globally routable, so the
service cannot be used to reach or probe its own network. Checked at submit and again before
every delivery. A refused name is answered the same whatever it resolved to; the addresses go
to the log only."""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("app.webhooks")

MAX_URL_CHARS = 2048
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

Resolver = Callable[[str, int], list[str]]


class WebhookUrlError(ValueError):
    """The URL is malformed, not http(s), or resolves to an address that is refused."""


def resolve_host(host: str, port: int) -> list[str]:
    """Every address the host resolves to (IPv4 and IPv6)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


# Special-purpose blocks (IANA's IPv4 and IPv6 special-purpose address registries) that are not
# globally reachable. ipaddress's is_global misses some of them (192.0.0.8, fec0::/10, ::/96 on
# Python 3.11), so the service keeps its own table, checked first.
_V4_BLOCKS = [
    (IPv4Network(net), what)
    for net, what in [
        ("0.0.0.0/8", "unspecified (this network)"),
        ("10.0.0.0/8", "private"),
        ("100.64.0.0/10", "shared (carrier-grade NAT)"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.0.2.0/24", "documentation"),
        ("192.88.99.0/24", "6to4 relay anycast"),
        ("192.168.0.0/16", "private"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("255.255.255.255/32", "broadcast"),
        ("240.0.0.0/4", "reserved"),
    ]
]
_V6_BLOCKS = [
    (IPv6Network(net), what)
    for net, what in [
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("64:ff9b:1::/48", "local-use NAT64"),
        ("100::/64", "discard-only"),
        ("2001::/32", "Teredo, not globally routable"),
        ("2001::/23", "IETF protocol assignments"),
        ("2001:db8::/32", "documentation"),
        ("3fff::/20", "documentation"),
        ("fc00::/7", "unique local (private)"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local"),
        ("ff00::/8", "multicast"),
    ]
]
_GLOBAL_UNICAST = IPv6Network("2000::/3")
_NAT64 = IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = IPv6Network("64:ff9b:1::/48")


def embedded_ipv4(ip: IPv6Address) -> list[tuple[IPv4Address, str]]:
    """The IPv4 addresses an IPv6 address stands for (IPv4-mapped, 6to4, Teredo server and
    client, NAT64 in the well-known /96 and the local-use /48 prefix), each with its form."""
    out: list[tuple[IPv4Address, str]] = []
    if ip.ipv4_mapped is not None:
        out.append((ip.ipv4_mapped, "IPv4-mapped"))
    if ip.sixtofour is not None:
        out.append((ip.sixtofour, "6to4"))
    if ip.teredo is not None:
        server, client = ip.teredo
        out += [(client, "Teredo client"), (server, "Teredo server")]
    if ip in _NAT64:
        out.append((IPv4Address(ip.packed[12:]), "NAT64"))
    if ip in _NAT64_LOCAL:  # RFC 6052 /48: bits 48-63 and 72-87 (bits 64-71 are zero)
        out.append((IPv4Address(ip.packed[6:8] + ip.packed[9:11]), "local-use NAT64"))
    return out


def _v4_reason(ip: IPv4Address) -> str | None:
    for net, what in _V4_BLOCKS:
        if ip in net:
            return what
    return None if ip.is_global else "not globally routable"


def refused_reason(address: str) -> str | None:
    """Why an address is not a globally routable one, or None when it is. An IPv6 address that
    carries an IPv4 address (6to4, Teredo, NAT64, IPv4-mapped) is judged by that one too."""
    ip = ip_address(address.split("%", 1)[0])
    if isinstance(ip, IPv4Address):
        return _v4_reason(ip)
    inner = embedded_ipv4(ip)
    for v4, form in inner:
        reason = _v4_reason(v4)
        if reason is not None:
            return f"{reason} ({form} of {v4})"
    if ip.ipv4_mapped is not None:
        return None
    for net, what in _V6_BLOCKS:
        if ip in net:
            return what
    if ip not in _GLOBAL_UNICAST and ip not in _NAT64:
        return "not global unicast"
    return None if ip.is_global else "not globally routable"


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
    if _CONTROL.search(url):
        raise WebhookUrlError(
            "webhook_url must not contain control characters (U+0000-U+001F, U+007F)"
        )
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
    literal = _ip_literal(host)
    if literal is not None:  # the caller wrote the address: say what is wrong with it
        reason = refused_reason(literal)
        if reason is not None:
            raise WebhookUrlError(
                f"webhook_url host {host!r} is a {reason} address; webhooks go to globally "
                f"routable addresses only ({_ALLOW_PRIVATE})"
            )
        return [literal]
    try:
        addresses = (resolver or resolve_host)(
            host, port or (443 if parts.scheme == "https" else 80)
        )
    except (OSError, UnicodeError) as e:
        log.info("webhook_url host %r refused: it does not resolve (%s)", host, e)
        raise WebhookUrlError(_not_allowed(host)) from None
    refused = [(a, r) for a in addresses if (r := refused_reason(a)) is not None]
    if refused or not addresses:
        # What the name resolved to stays in the log: the answer would map internal DNS.
        log.info("webhook_url host %r refused: %s", host, refused or "no address")
        raise WebhookUrlError(_not_allowed(host))
    return addresses


_ALLOW_PRIVATE = "an operator may allow private ones with HIGGS_WEBHOOK_ALLOW_PRIVATE=1"


def _not_allowed(host: str) -> str:
    """The one answer for a name that is refused, whatever it resolved to (or did not)."""
    return (
        f"webhook_url host {host!r} is not allowed: webhooks go to hosts whose every address "
        f"is globally routable ({_ALLOW_PRIVATE})"
    )


def _ip_literal(host: str) -> str | None:
    """host as an address when it is one (urlsplit's hostname has no brackets), else None."""
    try:
        ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    return host
