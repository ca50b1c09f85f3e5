"""The door's catch-all error handler: an unexpected exception answers 500 in the one error shape."""

from __future__ import annotations

import logging

import httpx
import pytest

from services.api.router import create_app
from services.api.settings import ApiSettings

INTERNAL = {"error": {"code": "internal_error", "message": "internal server error (see the server log)"}}


class BrokenGuard:
    """A guard with a bug: every check raises (passed in as the door's collaborator)."""

    async def check(self, request):
        raise RuntimeError("secret detail that must not reach the client")

    admit = check  # the submit route's first step


@pytest.mark.parametrize("method, path, fast_path", [
    ("POST", "/v1/ocr", True),  # the fast path (SubmitFastPath middleware)
    ("POST", "/v1/ocr", False),  # the same endpoint through FastAPI's routing (OCRSTREAM_HTTP_FAST_PATH=false)
    ("POST", "/v1/ocr/batch", True),  # routed
    ("GET", "/v1/ocr/some-id", True),
])
async def test_an_unexpected_exception_is_a_json_500_and_its_traceback_is_logged(method, path, fast_path, caplog):
    app = create_app(ApiSettings(webhook_enabled=False, http_fast_path=fast_path))
    app.state.clients.guard = BrokenGuard()
    caplog.set_level(logging.ERROR, logger="services.api.errors")
    # the ASGI app without its lifespan: nothing connects; the exception is still raised past the answer
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://door") as c:
        r = await c.request(method, path, content=b"\x89PNG", headers={"Content-Type": "image/png"})
    assert r.status_code == 500, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json() == INTERNAL
    [rec] = [rec for rec in caplog.records if rec.name == "services.api.errors"]
    assert rec.getMessage() == f"api: unhandled RuntimeError on {method} {path}"
    assert rec.exc_info[0] is RuntimeError and "secret detail" in str(rec.exc_info[1])
