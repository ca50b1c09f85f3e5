"""CORS on the real door, with origins set: the preflight, the answers' headers, other origins refused."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import text_image
from tests.integration.conftest import API_ENV
from tests.stack import API

pytestmark = pytest.mark.stack

ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def cors_api(pipeline):
    """A door with ``OCRSTREAM_HTTP_CORS_ORIGINS`` naming one origin (accepting no callback)."""
    st = pipeline.start(API, extra_env={**API_ENV, "OCRSTREAM_WEBHOOK_ENABLED": "false",
                                        "OCRSTREAM_HTTP_CORS_ORIGINS": f'["{ORIGIN}"]'})
    st.url = f"http://127.0.0.1:{st.port}"
    yield st
    pipeline.stop(st)


def test_a_page_on_an_allowed_origin_may_post_with_its_key_and_read_retry_after(cors_api):
    with httpx.Client(base_url=cors_api.url, timeout=90) as c:
        pre = c.options("/v1/ocr", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "x-api-key, content-type"})
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == ORIGIN
        assert {"x-api-key", "content-type"} <= {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
        assert "POST" in {m.strip() for m in pre.headers["access-control-allow-methods"].split(",")}

        # the POST /v1/ocr fast path sits inside the CORS middleware: its answers carry the headers
        r = c.post("/v1/ocr", content=text_image(["CORS 2929"], size=40),
                   headers={"Origin": ORIGIN, "Content-Type": "image/png"})
        assert r.status_code in (200, 202), r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert r.headers["access-control-expose-headers"].lower() == "retry-after"
        # error answers too (a 429's or 503's Retry-After is read off them)
        bad = c.post("/v1/ocr", content=b"not an image", headers={"Origin": ORIGIN, "Content-Type": "image/png"})
        assert bad.status_code == 415 and bad.json()["error"]["code"] == "unsupported_format"
        assert bad.headers["access-control-allow-origin"] == ORIGIN
        assert bad.headers["access-control-expose-headers"].lower() == "retry-after"
        got = c.get(f"/v1/ocr/{r.json()['request_id']}", params={"wait": 60}, headers={"Origin": ORIGIN})
        assert got.json()["status"] == "ok" and got.headers["access-control-allow-origin"] == ORIGIN

        # another origin: the preflight is refused and answers name no origin
        evil = c.options("/v1/ocr", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
        other = c.post("/v1/ocr", content=b"not an image",
                       headers={"Origin": "https://evil.example", "Content-Type": "image/png"})
        assert other.status_code == 415 and "access-control-allow-origin" not in other.headers
