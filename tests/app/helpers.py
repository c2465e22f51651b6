"""Shared pieces of the HTTP tests."""

from __future__ import annotations

from typing import Any


def assert_problem(r: Any, status: int, field: str | None = None) -> dict[str, Any]:
    """`r` is an RFC 9457 problem+json response with this status (and this field error)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body: dict[str, Any] = r.json()
    assert body["status"] == status and body["title"] and body["type"] and body["detail"]
    if field is not None:
        assert field in [e["field"] for e in body["errors"]], body
    return body
