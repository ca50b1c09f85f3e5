"""/docs and /redoc load nothing from a CDN: their pages point at the door's own copies of Swagger UI and
ReDoc (the fastapi-offline package), under a policy that allows the door only (the ASGI app without its
lifespan; the pages in a real browser: tests/integration/test_web_docs.py)."""

from __future__ import annotations

import re

import httpx

from services.api.docs_pages import ASSETS_URL, REDOC_LOGO, inline_hashes, redoc_bundle, redoc_csp, swagger_csp
from services.api.router import create_app
from services.api.settings import ApiSettings


async def _get(*paths: str) -> list[httpx.Response]:
    app = create_app(ApiSettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://door") as c:
        return [await c.get(p) for p in paths]


async def test_the_pages_load_their_assets_from_the_door():
    docs, redoc, js, css, bundle, icon, oauth = await _get(
        "/docs", "/redoc", f"{ASSETS_URL}/swagger-ui-bundle.js", f"{ASSETS_URL}/swagger-ui.css",
        f"{ASSETS_URL}/redoc.standalone.js", f"{ASSETS_URL}/favicon.png", "/docs/oauth2-redirect")
    for page in (docs, redoc):
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert re.findall(r'(?:src|href)="([^"]+)"', page.text) == [
            f"{ASSETS_URL}/{name}" for name in (("swagger-ui.css", "favicon.png", "swagger-ui-bundle.js") if page is docs
                                                else ("favicon.png", "redoc.standalone.js"))]
        assert "http" not in page.text.replace("http-equiv", "")
    assert "url: '/openapi.json'" in docs.text and '"validatorUrl": null' in docs.text  # no validator.swagger.io badge
    assert 'spec-url="/openapi.json"' in redoc.text
    assert (js.status_code, css.status_code, icon.status_code) == (200, 200, 200)
    assert js.headers["content-type"] == "text/javascript; charset=utf-8" and len(js.content) > 1_000_000
    assert bundle.content == redoc_bundle() and REDOC_LOGO[0].encode() not in bundle.content
    assert oauth.status_code == 404  # the door has no OAuth flow: no redirect page


async def test_their_policies_allow_the_door_and_the_swagger_pages_one_inline_script():
    docs, redoc = await _get("/docs", "/redoc")
    [script] = re.findall(r"<script>(.*?)</script>", docs.text, re.S)
    assert "SwaggerUIBundle(" in script
    assert inline_hashes(docs.text, "script").startswith("'sha256-") and inline_hashes(docs.text, "style") == ""
    assert docs.headers["content-security-policy"] == swagger_csp(docs.text) == (
        "default-src 'none'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; frame-ancestors 'none'; "
        f"script-src 'self' {inline_hashes(docs.text, 'script')}; style-src 'self'; form-action 'self'")
    assert redoc.headers["content-security-policy"] == redoc_csp(redoc.text)
    # FastAPI's own pages (a CDN) are gone, and the spec does not list these pages
    spec = create_app(ApiSettings()).openapi()
    assert not {"/docs", "/redoc"} & set(spec["paths"])
