"""``OCRSTREAM_CACHE_ENABLED=false`` on the HTTP door: no upload is answered from the cache."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import text_image
from tests.integration.conftest import API_ENV
from tests.stack import API

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def cache_off_door(pipeline):
    """A second HTTP door with the cache lookup off (the session's dedup keeps its cache on)."""
    st = pipeline.start(API, extra_env={**API_ENV, "OCRSTREAM_WEBHOOK_ENABLED": "false",
                                        "OCRSTREAM_CACHE_ENABLED": "false"})
    st.url = f"http://127.0.0.1:{st.port}"
    yield st
    pipeline.stop(st)


def test_door_with_the_cache_off_sends_a_cached_image_on_instead_of_answering_it(api, cache_off_door):
    img = text_image(["CACHE OFF DOOR", "SENT ON"], size=40)
    with httpx.Client(base_url=api.url, timeout=90) as c:
        first = c.post("/v1/ocr", content=img, headers={"Content-Type": "image/png"})
        assert first.status_code == 202, first.text
        done = c.get(f"/v1/ocr/{first.json()['request_id']}", params={"wait": 60}).json()
        assert done["status"] == "ok" and done["result"]["text"] == "CACHE OFF DOOR\nSENT ON"
        # the usual door answers the repeat at once from the cache
        assert c.post("/v1/ocr", content=img, headers={"Content-Type": "image/png"}).status_code == 200

    with httpx.Client(base_url=cache_off_door.url, timeout=90) as c:
        r = c.post("/v1/ocr", content=img, headers={"Content-Type": "image/png"})
        assert r.status_code == 202, r.text  # not answered from the cache
        assert r.json()["status"] == "pending"
        got = c.get(f"/v1/ocr/{r.json()['request_id']}", params={"wait": 60}).json()
    # dedup (cache on in this pipeline) completed it from the cache, with the same text
    assert got["status"] == "ok", got
    assert got["result"]["text"] == "CACHE OFF DOOR\nSENT ON"
    assert got["result"]["cache_hit"] is True
