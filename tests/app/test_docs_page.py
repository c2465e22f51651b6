"""GET /docs: Swagger UI from files this package ships, under the console's
Content-Security-Policy; nothing is loaded from another origin."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.settings import Settings
from app.ui import SECURITY_HEADERS
from tests.fixtures import serve_app

CHROMIUM = Path(os.environ.get("HIGGS_TEST_CHROMIUM", "/usr/bin/chromium"))


def test_docs_page_and_its_assets_are_served_from_this_origin(client: TestClient) -> None:
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = SECURITY_HEADERS["Content-Security-Policy"]
    assert r.headers["content-security-policy"] == csp
    assert "script-src 'self'" in csp
    assert "//" not in r.text, "the page names another origin"
    assert not re.search(r"<script>[^<]", r.text), "an inline script (the CSP refuses it)"
    assets = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert len(assets) == 3, assets
    for path in assets:
        a = client.get(path)
        assert a.status_code == 200, path
        assert a.headers["content-security-policy"] == csp
        assert "//cdn" not in a.text
    assert client.get("/redoc").status_code == 404


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing")
def test_docs_page_renders_in_a_browser_under_the_csp(settings: Settings) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    with serve_app(settings) as base, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page()
            problems: list[str] = []
            elsewhere: list[str] = []
            page.on(
                "console",
                lambda m: problems.append(m.text) if m.type in ("error", "warning") else None,
            )
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on(
                "request",
                lambda req: None if req.url.startswith(base) else elsewhere.append(req.url),
            )
            page.goto(f"{base}/docs")
            page.wait_for_selector(".opblock-summary-path", timeout=30_000)
            paths = page.locator(".opblock-summary-path").all_inner_texts()
            assert any("/v1/jobs" in p for p in paths), paths
            assert elsewhere == [], elsewhere
            csp = [p for p in problems if "Content Security Policy" in p or "Refused" in p]
            assert csp == [], csp
        finally:
            browser.close()
