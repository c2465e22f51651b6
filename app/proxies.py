"""The proxies whose forwarded headers the API believes (HIGGS_FORWARDED_ALLOW_IPS): parsed once,
checked per request by app.front_door.ForwardedForMiddleware."""

from __future__ import annotations

import ipaddress

__all__ = ["TrustedProxies"]

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class TrustedProxies:
    """The proxies whose X-Forwarded-For is believed: a comma-separated list of addresses and
    networks (`10.0.0.0/8`), or `*` for any peer; empty: none."""

    def __init__(self, spec: str) -> None:
        self.any = False
        self.networks: list[IpNetwork] = []
        for entry in (e.strip() for e in spec.split(",")):
            if not entry:
                continue
            if entry == "*":
                self.any = True
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError as exc:
                raise ValueError(
                    f"{entry!r} is not an IP address or network (give addresses like "
                    "127.0.0.1 or 10.0.0.0/8, or *)"
                ) from exc

    def __bool__(self) -> bool:
        return self.any or bool(self.networks)

    def __contains__(self, host: str) -> bool:
        if self.any:
            return True
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(addr in net for net in self.networks)

    def client(self, forwarded_for: str) -> str | None:
        """The client of an X-Forwarded-For chain sent by a trusted peer: the right-most entry
        that is not a trusted proxy (the left-most when every one is); None when empty."""
        hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
        for hop in reversed(hops):
            if hop not in self:
                return hop
        return hops[0] if hops else None
