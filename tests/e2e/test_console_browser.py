"""The web console in a real browser (Playwright driving Debian's chromium, never a downloaded
browser) against real processes: uvicorn, a Celery worker, SQLite + the filesystem broker.

One run signs in (a wrong key first), sees a 422 next to the field it names, submits a job on
the tiny model with a webhook to a local receiver, watches it reach "succeeded" on the job
page, opens the per-layer chart, downloads the native archive through its signed link and
checks every file's sha256 against the API's listing, and cancels a slow job. The webhook
receiver answers 500 first: the event is retried, signed with the key's secret, and nothing
reaches it for another tenant's job.

HIGGS_CONSOLE_SCREENSHOT=PATH saves the job page screenshot there (the README's picture).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tarfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from app.webhooks.signing import verify
from tests.e2e.test_service_e2e import poll, start_separate, submit, terminal
from tests.fixtures import TINY_MODEL as MODEL

pytestmark = pytest.mark.slow

CHROMIUM = Path(os.environ.get("HIGGS_TEST_CHROMIUM", "/usr/bin/chromium"))
# Slow enough to click Cancel mid-job (tiny model: 14 layers), fast enough for the rest.
WORKER_ENV = {
    "HIGGS_DEBUG_LAYER_DELAY_S": "0.4",
    "HIGGS_WEBHOOK_ALLOW_PRIVATE": "1",
    "HIGGS_WEBHOOK_BACKOFF_S": "0.5",
    "HIGGS_WEBHOOK_INTERVAL_S": "0.2",
}
UI_TIMEOUT_MS = 120_000
JOB_PAGE = re.compile(r"/ui/#/jobs/[0-9a-f-]{36}$")


class Receiver:
    def __init__(self) -> None:
        self.got: list[tuple[dict[str, str], bytes]] = []
        self.codes = [500]  # the first POST fails; the retry succeeds
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                rec.got.append((dict(self.headers.items()), body))
                self.send_response(rec.codes.pop(0) if rec.codes else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (scripts/setup installs Debian's chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield b
        finally:
            b.close()


def test_console_in_a_browser(
    stack_factory: Any, browser: Any, receiver: Receiver, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    stack = stack_factory("local")
    stack.env["HIGGS_WEBHOOK_ALLOW_PRIVATE"] = "1"  # the API accepts the 127.0.0.1 receiver
    # A tiny data-free profile, so that an avg_bits job makes one for the Preview.
    stack.env.update({"HIGGS_PROFILE_CONTEXT": "16", "HIGGS_PROFILE_WINDOWS": "1"})
    start_separate(stack, WORKER_ENV)
    key = stack.create_key("browser")
    other_key = stack.create_key("someone-else")
    c, other = stack.client(key), stack.client(other_key)

    ctx = browser.new_context(accept_downloads=True, viewport={"width": 1100, "height": 900})
    page = ctx.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))

    # --- sign in: a wrong key shows the API's error next to the field; then the real key,
    # typed and submitted with the keyboard.
    page.goto(stack.url + "/ui")
    page.get_by_label("API key").fill("higgs_wrong")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#api-key-error")).to_contain_text("401")
    expect(page.locator("#api-key-error")).to_contain_text("unknown API key")
    expect(page.get_by_label("API key")).to_have_attribute("aria-invalid", "true")
    page.get_by_label("API key").fill(key)
    page.get_by_label("API key").press("Enter")
    expect(page.get_by_role("heading", name="Jobs")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('higgs.apiKey')") == key

    # --- a 422 shown next to the field it names; Preview says there is no profile yet.
    page.get_by_role("link", name="New job").click()
    page.get_by_label("Model").fill(MODEL)
    page.get_by_label("Target bits").fill("0.5")
    page.get_by_role("button", name="Quantize").click()
    field_error = page.locator("#target-bits-error")
    expect(field_error).to_contain_text("422")
    expect(page.get_by_label("Target bits")).to_have_attribute("aria-invalid", "true")
    expect(page.get_by_label("Target bits")).to_be_focused()
    page.get_by_label("Model").fill("no-such-model")
    page.get_by_label("Target bits").fill("4")
    page.get_by_role("button", name="Quantize").click()
    expect(page.locator("#model-error")).to_contain_text("422")
    expect(page.locator("#target-bits-error")).to_be_empty()
    page.get_by_label("Model").fill(MODEL)
    page.get_by_role("button", name="Preview").click()
    expect(page.locator("#preview-text")).to_contain_text("no profile exists yet")
    assert c.get("/v1/jobs").json()["data"] == []  # nothing was submitted so far

    # --- submit (uniform 4 bits, with a webhook) and watch it on the job page.
    page.get_by_label("Uniform bits").check()
    page.get_by_label("Webhook URL (optional)").fill(receiver.url)
    page.get_by_role("button", name="Quantize").click()
    page.wait_for_url(JOB_PAGE)
    expect(page.get_by_role("heading", name="Job ")).to_be_visible()
    job_id = page.url.rsplit("/", 1)[1]
    status = page.locator("#job-status-value")
    seen: set[str] = set()
    deadline = time.monotonic() + UI_TIMEOUT_MS / 1000
    while time.monotonic() < deadline and "succeeded" not in seen:
        seen.add(status.text_content() or "")
        if page.locator("#job-progress-text").text_content():
            seen.add("progress:" + (page.locator("#job-progress-text").text_content() or ""))
        time.sleep(0.1)
    assert "succeeded" in seen, (seen, stack.logs())
    assert any(s.startswith("progress:") and " of " in s for s in seen), seen  # the SSE progress
    expect(page.locator("#job-cancel")).to_be_hidden()
    expect(page.locator("#job-summary")).to_contain_text("Bits per weight")
    job = c.get(f"/v1/jobs/{job_id}").json()
    assert job.get("status") == "succeeded", (page.url, job)
    assert job["status"] == "succeeded" and job["webhook_url"] == receiver.url
    bpw = f"{job['summary']['bits_per_weight']:.3f}"
    expect(page.locator("#job-summary")).to_contain_text(bpw)

    # --- the per-layer chart: one bar per layer.
    layers = c.get(f"/v1/jobs/{job_id}/layers").json()["data"]
    page.get_by_text("Per-layer chart", exact=True).click()
    chart = page.locator("#layers-svg")
    expect(chart).to_be_visible()
    assert chart.locator("rect.bar").count() == len(layers) > 0
    assert chart.locator("circle.err").count() == sum(
        1 for x in layers if x["rel_error"] is not None
    )
    shot = tmp_path / "console-job.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("HIGGS_CONSOLE_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["HIGGS_CONSOLE_SCREENSHOT"])

    # --- download the native archive through its signed link; sha256 of every file matches.
    link = page.get_by_role("link", name="Download native")
    expect(link).to_have_attribute("href", re.compile(r"/archive\?token="))
    with page.expect_download() as info:
        link.click()
    download = info.value
    assert "token=" in download.url and key not in download.url
    listing = c.get(f"/v1/jobs/{job_id}/artifacts/native").json()
    want = {f"native/{f['path']}": f["sha256"] for f in listing["files"]}
    got: dict[str, str] = {}
    with tarfile.open(download.path()) as tar:
        for m in tar.getmembers():
            fh = tar.extractfile(m)
            assert fh is not None
            got[m.name] = hashlib.sha256(fh.read()).hexdigest()
    assert got == want
    expect(page.get_by_role("link", name="Download dequantized")).to_be_visible()
    assert all(key not in u for u in requests)  # the key is never in a URL

    # --- the jobs list shows it live; a narrow screen does not scroll sideways.
    page.get_by_role("link", name="Jobs").click()
    row = page.locator(f'tr[data-job-id="{job_id}"]')
    expect(row).to_contain_text("succeeded")
    expect(row).to_contain_text("4 bits (uniform)")
    expect(row).to_contain_text(bpw)
    page.set_viewport_size({"width": 360, "height": 800})
    page.goto(f"{stack.url}/ui/#/jobs/{job_id}")
    expect(page.locator("#job-status-value")).to_have_text("succeeded")
    assert page.evaluate("document.documentElement.scrollWidth") <= 362
    page.set_viewport_size({"width": 1100, "height": 900})

    # --- cancel a slow job from its page.
    page.get_by_role("link", name="New job").click()
    page.get_by_label("Model").fill(MODEL)
    page.get_by_label("Target bits").fill("3")
    page.get_by_label("Webhook URL (optional)").fill("")
    page.get_by_role("button", name="Quantize").click()
    page.wait_for_url(JOB_PAGE)
    expect(page.locator("#job-status-value")).to_have_text("running", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#job-progress-text")).to_contain_text(" of ", timeout=UI_TIMEOUT_MS)
    page.get_by_role("button", name="Cancel").click()
    expect(page.locator("#job-status-value")).to_have_text("cancelled", timeout=UI_TIMEOUT_MS)
    expect(page.get_by_role("button", name="Cancel")).to_be_hidden()
    cancelled_id = page.url.rsplit("/", 1)[1]
    assert c.get(f"/v1/jobs/{cancelled_id}").json()["status"] == "cancelled"

    # --- webhooks: another tenant's job (no webhook) delivers nothing to the receiver; ours
    # was retried after the 500 and verifies under our key's secret only.
    theirs = submit(other)
    poll(other, theirs, terminal, stack=stack)
    deliveries = poll_deliveries(c, job_id)
    assert deliveries["data"][0]["state"] == "delivered"
    assert [e["status_code"] for e in deliveries["data"][0]["attempt_log"]] == [500, 200]
    secret = c.get("/v1/webhooks/secret").json()["secret"]
    other_secret = other.get("/v1/webhooks/secret").json()["secret"]
    time.sleep(1.0)  # the dispatcher would have sent anything else by now
    assert len(receiver.got) == 2
    for headers, body in receiver.got:
        event = json.loads(body)
        assert event["job_id"] == job_id and event["status"] == "succeeded"
        assert verify(secret, body, headers["Higgs-Signature"])
        assert not verify(other_secret, body, headers["Higgs-Signature"])
    assert other.get(f"/v1/jobs/{theirs}/webhooks").json()["data"] == []
    page.goto(f"{stack.url}/ui/#/jobs/{job_id}")  # the job page lists the delivery
    expect(page.locator("#webhooks-table")).to_contain_text("delivered")
    expect(page.locator("#webhooks-table")).to_contain_text("HTTP 200")

    # --- Preview once the model has a profile (an avg_bits job makes one): the predicted
    # quality-against-bits curve with the chosen point marked.
    r = c.post("/v1/jobs", json={"model": {"id": MODEL}, "target": {"avg_bits": 3.5}})
    assert r.status_code == 202, r.text
    assert poll(c, r.json()["id"], terminal, stack=stack)["status"] == "succeeded"
    page.get_by_role("link", name="New job").click()
    page.get_by_label("Model").fill(MODEL)
    page.get_by_label("Average bits").check()
    page.get_by_label("Target bits").fill("3.5")
    page.get_by_role("button", name="Preview").click()
    expect(page.locator("#preview-text")).to_contain_text("chosen: 3.")
    curve = page.get_by_role("img", name="Predicted quality against bits")
    expect(curve).to_be_visible()
    assert curve.locator("path.curve").count() == 1
    assert curve.locator("circle.chosen").count() == 1
    assert errors == [], errors
    ctx.close()


def poll_deliveries(c: Any, job_id: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = c.get(f"/v1/jobs/{job_id}/webhooks").json()
        if body["data"] and body["data"][0]["state"] != "pending":
            return body
        time.sleep(0.2)
    raise AssertionError(f"no finished delivery for {job_id} in {timeout}s: {body}")
