"""The API explorer pages of the real door, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), in headless
Chromium (Debian's, scripts/browser.sh) with every request to a host other than 127.0.0.1 cut off, as
on an air-gapped network: both pages render the spec from the door alone, every request the browser
makes goes to the door, and nothing breaks their Content-Security-Policy."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from services.api.docs_pages import ASSETS_URL, redoc_csp, swagger_csp

pytestmark = pytest.mark.stack

CHROMIUM = Path("/usr/bin/chromium")


def _host(url: str) -> str | None:
    """The host a request goes to (a ``blob:`` URL's is its origin's); None for ``data:``."""
    if url.startswith("data:"):
        return None
    return urlparse(url[len("blob:"):] if url.startswith("blob:") else url).hostname


class Browser:
    """One browser context on the door: every request it makes, every script or console error, every
    CSP violation; requests to any other host are aborted (recorded all the same)."""

    def __init__(self, context):
        self.context = context
        self.requests: list[str] = []
        self.errors: list[str] = []
        context.on("request", lambda r: self.requests.append(r.url))
        context.route(lambda url: _host(url) not in (None, "127.0.0.1"), lambda route: route.abort())

    def open(self, url: str):
        page = self.context.new_page()
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.on("console", lambda m: m.type in ("error", "warning") and self.errors.append(f"{m.type}: {m.text}"))
        page.add_init_script("document.addEventListener('securitypolicyviolation', "
                             "e => console.error('CSP violation: ' + e.violatedDirective + ' ' + e.blockedURI))")
        page.goto(url)
        return page

    def off_loopback(self) -> list[str]:
        return [u for u in self.requests if _host(u) not in (None, "127.0.0.1")]


@pytest.fixture
def browser(api):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} missing: run scripts/browser.sh", pytrace=False)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        ctx = b.new_context(viewport={"width": 1280, "height": 900})
        yield Browser(ctx)
        b.close()


def _operations(api) -> list[tuple[str, str]]:
    spec = httpx.get(f"{api.url}/openapi.json", timeout=30).json()
    return sorted((method.upper(), path) for path, item in spec["paths"].items() for method in item)


def test_swagger_ui_renders_every_operation_from_the_door_alone(api, browser):
    page = browser.open(f"{api.url}/docs")
    ops = page.locator(".opblock")
    expect(ops.first).to_be_visible(timeout=30_000)
    expect(page.locator(".info .title")).to_contain_text("ocrstream")
    shown = sorted((page.locator(".opblock-summary-method").nth(i).inner_text(),
                    page.locator(".opblock-summary-path").nth(i).get_attribute("data-path")) for i in range(ops.count()))
    assert shown == _operations(api) and ("GET", "/v1/tasks") in shown
    # an operation opens with its parameters and their bounds, read from the spec
    page.locator(".opblock-summary-path[data-path='/v1/ocr/{request_id}']").click()
    expect(page.locator(".parameters-container")).to_contain_text("OCRSTREAM_HTTP_WAIT_MAX_S")
    assert set(browser.requests) == {f"{api.url}/docs", f"{api.url}{ASSETS_URL}/swagger-ui.css",  # (the icon: twice)
                                     f"{api.url}{ASSETS_URL}/swagger-ui-bundle.js", f"{api.url}/openapi.json",
                                     f"{api.url}{ASSETS_URL}/favicon.png"}
    assert browser.off_loopback() == [] and browser.errors == []


def test_redoc_renders_and_searches_from_the_door_alone(api, browser):
    page = browser.open(f"{api.url}/redoc")
    expect(page.locator("h1").first).to_have_text("ocrstream (1)", timeout=30_000)
    expect(page.locator("h2", has_text="Submit one image")).to_be_visible()
    expect(page.locator("h2", has_text="The tasks this deployment runs")).to_be_attached()
    assert page.get_by_role("menu").first.get_by_role("menuitem").all_inner_texts()[:3] == ["ocr", "jobs", "ops"]
    page.locator("input[placeholder='Search...']").fill("job")  # the search index runs in a blob: worker
    expect(page.locator("[data-role='search:results'] li").first).to_be_visible(timeout=10_000)
    expect(page.get_by_text("API docs by Redocly")).to_be_visible()  # its logo is not fetched from Redocly
    assert page.locator("img[src^='http']").count() == 0
    hosts = {_host(u) for u in browser.requests}
    assert hosts == {"127.0.0.1"}, browser.requests
    assert {u for u in browser.requests if not u.startswith("blob:")} == {
        f"{api.url}/redoc", f"{api.url}{ASSETS_URL}/redoc.standalone.js", f"{api.url}/openapi.json",
        f"{api.url}{ASSETS_URL}/favicon.png"}
    assert browser.off_loopback() == [] and browser.errors == []


def test_the_pages_policies_allow_the_door_only(api):
    """The policies the browser enforced above, as the door sends them: no host but its own, no inline
    script but the Swagger UI page's own (by hash); ReDoc's bundle without Redocly's logo address."""
    docs = httpx.get(f"{api.url}/docs", timeout=30)
    csp = docs.headers["content-security-policy"]
    assert csp == swagger_csp(docs.text) and "'unsafe-inline'" not in csp and "http" not in csp
    assert "script-src 'self' 'sha256-" in csp and "cdn." not in docs.text
    redoc = httpx.get(f"{api.url}/redoc", timeout=30)
    assert redoc.headers["content-security-policy"] == redoc_csp(redoc.text) == (
        "default-src 'none'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; frame-ancestors 'none'; "
        "script-src 'self'; style-src 'self' 'unsafe-inline'; worker-src blob:; form-action 'none'")
    assert "fonts.googleapis" not in redoc.text and "cdn." not in redoc.text
    bundle = httpx.get(f"{api.url}{ASSETS_URL}/redoc.standalone.js", timeout=30)
    assert bundle.status_code == 200 and bundle.headers["content-type"] == "text/javascript; charset=utf-8"
    assert b"cdn.redoc.ly" not in bundle.content and len(bundle.content) > 1_000_000
    again = httpx.get(f"{api.url}{ASSETS_URL}/redoc.standalone.js", headers={"If-None-Match": bundle.headers["etag"]},
                      timeout=30)
    assert again.status_code == 304
