"""The console's GGUF path in a real browser (Playwright, Debian's chromium) against uvicorn and
a Celery worker: the Output choice submits a GGUF job, the job page offers the GGUF download
and a "Run it" box naming the file; the downloaded archive matches the API's listing by sha256
and its file runs in llama.cpp."""

from __future__ import annotations

import hashlib
import re
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_console_browser import JOB_PAGE, UI_TIMEOUT_MS, browser  # noqa: F401
from tests.e2e.test_service_e2e import start_separate
from tests.fixtures import build_gguf_llama

pytestmark = pytest.mark.slow

MODEL = "tiny-gguf"


def test_console_gguf_job_and_download(
    stack_factory: Any,
    browser: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    from playwright.sync_api import expect

    from higgs_engine.gguf.llama import LlamaModel

    models = tmp_path / "models"
    build_gguf_llama(models / MODEL)
    stack = stack_factory("local")
    stack.env["HIGGS_MODELS_DIR"] = str(models)
    start_separate(stack)
    key = stack.create_key("browser")
    c = stack.client(key)

    ctx = browser.new_context(accept_downloads=True, viewport={"width": 1100, "height": 900})
    page = ctx.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(stack.url + "/ui")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("link", name="New job").click()
    page.get_by_label("Model").fill(MODEL)
    page.get_by_label("GGUF for llama.cpp").check()
    page.get_by_label("Target bits").fill("4")
    page.get_by_role("button", name="Quantize").click()
    page.wait_for_url(JOB_PAGE)
    job_id = page.url.rsplit("/", 1)[1]
    expect(page.locator("#job-status-value")).to_have_text("succeeded", timeout=UI_TIMEOUT_MS)
    job = c.get(f"/v1/jobs/{job_id}").json()
    assert job["request"]["options"]["formats"] == ["gguf"]
    assert [a["format"] for a in job["artifacts"]] == ["gguf"]

    expect(page.get_by_role("link", name="Download native")).to_be_hidden()
    link = page.get_by_role("link", name="Download GGUF")
    expect(link).to_have_attribute("href", re.compile(r"/artifacts/gguf/archive\?token="))
    listing = c.get(f"/v1/jobs/{job_id}/artifacts/gguf").json()
    (gguf_name,) = [f["path"] for f in listing["files"]]
    expect(page.locator("#run-it-commands")).to_contain_text(f"llama-cli -m gguf/{gguf_name}")
    expect(page.locator("#run-it-commands")).to_contain_text("ollama create")
    with page.expect_download() as info:
        link.click()
    dest = tmp_path / "dl"
    with tarfile.open(info.value.path()) as tar:
        names = tar.getnames()
        assert names == [f"gguf/{gguf_name}"]
        tar.extractall(dest, filter="data")
    data = (dest / "gguf" / gguf_name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == listing["files"][0]["sha256"]
    with LlamaModel(dest / "gguf" / gguf_name, n_ctx=16) as m:
        assert m.logits([1, 5, 9]).shape == (3, 320)
    page.get_by_text("Per-layer chart", exact=True).click()
    expect(page.locator("#layers-table")).to_contain_text("Q4_K")
    assert errors == [], errors
    ctx.close()
