"""The web console at /ui: static HTML, CSS and JavaScript shipped in this package (no build
step, nothing fetched from elsewhere at run time). It talks to the public REST API only.

GET /docs is Swagger UI on /openapi.json, from files vendored in static/swagger/ (see its
README.md) and under the same Content-Security-Policy."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STATIC = Path(__file__).resolve().parent / "static"

# Everything from this origin only; no inline scripts; the API key never leaves via referrers.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
        "form-action 'self'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


@router.get("/ui")
def ui_redirect() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui/")
def ui_index() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=SECURITY_HEADERS)


@router.get("/docs")
def api_docs() -> FileResponse:
    return FileResponse(
        STATIC / "swagger" / "docs.html", media_type="text/html", headers=SECURITY_HEADERS
    )


class _Headers:
    """Adds SECURITY_HEADERS to every response of the wrapped (static files) app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with)


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/ui/assets", _Headers(StaticFiles(directory=STATIC)), name="ui-assets")
