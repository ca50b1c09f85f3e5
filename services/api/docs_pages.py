"""The API explorer: ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), with their scripts and styles served
by the door itself, so they work where the browser reaches nothing but the door (offline, air-gapped).

FastAPI's own pages load Swagger UI and ReDoc from a CDN (cdn.jsdelivr.net): without internet they are
blank. The bundles come from the ``fastapi-offline`` package (pinned in pyproject.toml), which carries
``swagger-ui-bundle.js``, ``swagger-ui.css``, ``redoc.standalone.js`` and a favicon; they are mounted
at :data:`ASSETS_URL` (the package's own default path) straight from the installed package. The pages
are FastAPI's (``get_swagger_ui_html``, ``get_redoc_html``) pointed at them, without Google Fonts and
without Swagger UI's online validator badge (which would fetch validator.swagger.io).

Each page has a Content-Security-Policy allowing its own origin only: scripts and styles from the
door, its one inline script by hash (no ``'unsafe-inline'`` script), requests to the door (the spec;
Swagger UI's "Try it out"). ReDoc also needs inline styles (styled-components writes ``<style>``
elements) and a ``blob:`` worker (its search index). ReDoc's menu shows Redocly's logo from
cdn.redoc.ly, an address written into its bundle: the door serves the bundle with that address
replaced by an empty ``data:`` image (:data:`REDOC_LOGO`), which ReDoc then hides, so the page asks
nothing of any other host (the policy would block it, but the browser would still try and log it).
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse, Response

#: Where the bundles are served (fastapi-offline's default ``static_url``).
ASSETS_URL = "/static-offline-docs"
#: The package and folder that hold them.
ASSETS_PACKAGE = ("fastapi_offline", "static")
#: The logo ReDoc's menu loads from Redocly's CDN (``redoc.standalone.js`` 2.x), and what the door serves instead.
REDOC_LOGO = ("https://cdn.redoc.ly/redoc/logo-mini.svg", "data:,")
_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.S)  # no attributes: inline code, not <script src=...>
_COMMON = "default-src 'none'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; frame-ancestors 'none'"


def inline_hashes(html: str, tag: str) -> str:
    """CSP source expressions (``'sha256-…'``) of every inline ``<tag>`` block of ``html`` (a
    ``script`` or ``style`` element without attributes), space-separated."""
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
                    for kind, body in _INLINE.findall(html) if kind == tag)


def swagger_csp(html: str) -> str:
    """The Content-Security-Policy of the Swagger UI page ``html``: its bundle and its one inline
    script (by hash) from this origin, requests to this origin only (the spec, "Try it out")."""
    return (f"{_COMMON}; script-src 'self' {inline_hashes(html, 'script')}; style-src 'self'; "
            "form-action 'self'")


def redoc_csp(html: str) -> str:
    """The Content-Security-Policy of the ReDoc page ``html``: its bundle from this origin, inline
    styles (styled-components), its search worker from a ``blob:`` URL, requests to this origin only."""
    return f"{_COMMON}; script-src 'self'; style-src 'self' 'unsafe-inline'; worker-src blob:; form-action 'none'"


def redoc_bundle() -> bytes:
    """ReDoc's bundle as fastapi-offline ships it, with :data:`REDOC_LOGO`'s address replaced: the
    page then loads nothing from another host.

    Raises:
        RuntimeError: the bundle no longer holds that address (another ReDoc: check what it loads).
    """
    package, folder = ASSETS_PACKAGE
    text = (files(package) / folder / "redoc.standalone.js").read_text(encoding="utf-8")
    if REDOC_LOGO[0] not in text:
        raise RuntimeError(f"{package}'s redoc.standalone.js no longer loads {REDOC_LOGO[0]}: see what it loads now")
    return text.replace(REDOC_LOGO[0], REDOC_LOGO[1]).encode()


def add_docs_pages(app: FastAPI, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Serve ``docs_url`` (Swagger UI) and ``redoc_url`` (ReDoc) for ``app``'s spec with their assets
    from the door (:data:`ASSETS_URL`); ``app`` is built with ``docs_url=None, redoc_url=None``."""
    bundle: list[bytes] = []  # ReDoc's, read on first use (1 MB): building the app stays cheap

    @app.get(f"{ASSETS_URL}/redoc.standalone.js", include_in_schema=False)
    async def redoc_js(request: Request) -> Response:
        """ReDoc's bundle without its one address off the door (:func:`redoc_bundle`)."""
        if not bundle:
            bundle.append(redoc_bundle())
        etag = f'"{hashlib.sha256(bundle[0]).hexdigest()[:20]}"'
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"ETag": etag})
        return Response(bundle[0], media_type="text/javascript; charset=utf-8",
                        headers={"ETag": etag, "Cache-Control": "no-cache"})

    app.mount(ASSETS_URL, StaticFiles(packages=[ASSETS_PACKAGE]), name="docs-assets")  # the other assets, as shipped

    @app.get(docs_url, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        """Swagger UI for the spec (no CDN)."""
        root = request.scope.get("root_path", "")
        page = get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI", oauth2_redirect_url=None,
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None})  # no badge fetched from validator.swagger.io
        page.headers["Content-Security-Policy"] = swagger_csp(page.body.decode())
        return page

    @app.get(redoc_url, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        """ReDoc for the spec (no CDN, no Google Fonts)."""
        root = request.scope.get("root_path", "")
        page = get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js", redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            with_google_fonts=False)
        page.headers["Content-Security-Policy"] = redoc_csp(page.body.decode())
        return page
