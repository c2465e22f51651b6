"""Which proxies' forwarded headers are believed (HIGGS_FORWARDED_ALLOW_IPS): addresses,
networks, `*`; the client is the right-most forwarded hop that is not a trusted proxy."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.proxies import TrustedProxies
from app.settings import Settings


def test_none_trusted_by_default() -> None:
    trusted = TrustedProxies(Settings().forwarded_allow_ips)
    assert not trusted
    assert "127.0.0.1" not in trusted


def test_addresses_and_networks() -> None:
    trusted = TrustedProxies("127.0.0.1, 10.0.0.0/8,::1")
    assert "127.0.0.1" in trusted and "10.2.3.4" in trusted and "::1" in trusted
    assert "11.0.0.1" not in trusted and "not-an-ip" not in trusted
    assert "203.0.113.9" in TrustedProxies("*")


def test_client_is_the_right_most_untrusted_hop() -> None:
    trusted = TrustedProxies("10.0.0.0/8")
    # A client may write anything left of its own address; the proxies append what they saw.
    assert trusted.client("1.2.3.4, 198.51.100.7, 10.0.0.5") == "198.51.100.7"
    assert trusted.client("10.0.0.9, 10.0.0.5") == "10.0.0.9"
    assert trusted.client(" , ") is None


def test_a_bad_entry_is_refused_naming_it() -> None:
    with pytest.raises(ValidationError, match=r"'10\.0\.0\.300' is not an IP address"):
        Settings(forwarded_allow_ips="127.0.0.1,10.0.0.300")
