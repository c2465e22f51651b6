"""The OpenAPI document, exact and friendly to SDK generators.

Routes declare which statuses they send with `problems(...)`; `install_openapi` then renders
every 4xx/5xx answer as the one Problem schema under application/problem+json (with
Retry-After on 429/503 and WWW-Authenticate on 401), names operations by their route
function (`submit_job`, `get_job`, ...) and fills in the limits that come from Settings.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from app.errors import PROBLEM_JSON
from app.settings import Settings

DESCRIPTIONS = {
    304: "Not modified (If-None-Match matched the ETag)",
    400: "Malformed request (problem+json)",
    401: "Missing, unknown or revoked API key (problem+json)",
    404: "Not found, or another key's (problem+json)",
    409: "Conflict with the job's status (problem+json)",
    413: "Request body too large (problem+json)",
    416: "Range not satisfiable (problem+json)",
    422: "A field is invalid; `errors` names it (problem+json)",
    429: "Rate limit or job quota exceeded; retry after Retry-After seconds (problem+json)",
    500: "The artifact store lost a listed file (problem+json)",
    503: "Database or broker unavailable; retry after Retry-After seconds (problem+json)",
}
# What every request with an API key can be answered besides its own statuses.
AUTHENTICATED = (401, 429, 503)

PROBLEM_SCHEMA: dict[str, Any] = {
    "title": "Problem",
    "description": "RFC 9457 problem details",
    "type": "object",
    "required": ["type", "title", "status", "detail", "code"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "code": {"type": "string", "description": "stable machine-readable name"},
        "instance": {"type": "string"},
        "errors": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["field", "message"],
                "properties": {"field": {"type": "string"}, "message": {"type": "string"}},
            },
        },
        "checks": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before retrying",
        "schema": {"type": "integer", "minimum": 1},
    }
}
_WWW_AUTH = {"WWW-Authenticate": {"schema": {"type": "string"}}}


def problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these statuses (their bodies are filled in by install_openapi)."""
    return {code: {"description": DESCRIPTIONS[code]} for code in codes}


def operation_name(route: APIRoute) -> str:
    return route.name


def _finish(doc: dict[str, Any], settings: Settings) -> dict[str, Any]:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Problem"] = PROBLEM_SCHEMA
    ref = {"$ref": "#/components/schemas/Problem"}
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            for status, resp in op.get("responses", {}).items():
                code = int(status) if status.isdigit() else 0
                if code >= 400:
                    resp["description"] = DESCRIPTIONS.get(code, resp.get("description", ""))
                    resp["content"] = {PROBLEM_JSON: {"schema": ref}}
                    if code in (429, 503):
                        resp["headers"] = _RETRY_AFTER
                    if code == 401:
                        resp["headers"] = _WWW_AUTH
                elif code == 304:
                    resp.pop("content", None)
            if path == "/v1/jobs" and method == "get":
                for param in op.get("parameters", []):
                    if param["name"] == "limit":
                        param["schema"]["maximum"] = settings.page_limit_max
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    return doc


def install_openapi(app: FastAPI, settings: Settings) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            app.openapi_schema = _finish(doc, settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
