"""Hostile and odd input to the HTTP door on the real stack: request ids claimed by another key,
media types in other letter cases, request ids that are not path segments."""

from __future__ import annotations

import re
import uuid

import httpx
import pytest

from tests.conftest import text_image
from tests.integration.conftest import API_ENV
from tests.integration.test_http_auth import cli
from tests.stack import API

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def keyed_api(pipeline):
    """A door with keys required (no rate limit) and two keys made by the real CLI."""
    st = pipeline.start(API, extra_env={**API_ENV, "OCRSTREAM_AUTH_REQUIRED": "true", "OCRSTREAM_AUTH_CACHE_S": "0"})
    st.url = f"http://127.0.0.1:{st.port}"
    st.tokens = []
    for i in range(2):
        out = cli("keys", "create", "--name", f"adv-{uuid.uuid4().hex[:8]}-{i}")
        assert out.returncode == 0, out.stderr
        st.tokens.append(dict(re.findall(r"^(\w+):\s+(\S+)$", out.stdout, re.M))["api_key"])
    yield st
    for t in st.tokens:
        cli("keys", "revoke", t.split("_")[1])
    pipeline.stop(st)


def test_a_request_id_of_another_key_is_refused_and_stays_its_owners(keyed_api):
    rid = f"shared-{uuid.uuid4().hex[:10]}"
    mine, theirs = ({"X-API-Key": t, "Content-Type": "image/png"} for t in keyed_api.tokens)
    with httpx.Client(base_url=keyed_api.url, timeout=90) as c:
        r = c.post("/v1/ocr", content=text_image(["OWNER ONE"]), params={"request_id": rid}, headers=mine)
        assert r.status_code == 202, r.text
        r = c.post("/v1/ocr", content=text_image(["INTRUDER TWO"]), params={"request_id": rid}, headers=theirs)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "request_id_conflict"
        got = c.get(f"/v1/ocr/{rid}", params={"wait": 60}, headers={"X-API-Key": keyed_api.tokens[0]})
        assert got.status_code == 200 and got.json()["status"] == "ok", got.text
        assert got.json()["result"]["text"] == "OWNER ONE"
        assert c.get(f"/v1/ocr/{rid}", headers={"X-API-Key": keyed_api.tokens[1]}).status_code == 404


def test_media_types_are_case_insensitive(api):
    img = text_image([f"CASE {uuid.uuid4().hex[:6].upper()}"])
    body = (b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="c.png"\r\n'
            b"Content-Type: image/png\r\n\r\n" + img + b"\r\n--XyZ--\r\n")
    with httpx.Client(base_url=api.url, timeout=90) as c:
        raw = c.post("/v1/ocr", content=img, headers={"Content-Type": "IMAGE/PNG"})
        assert raw.status_code == 202, raw.text
        form = c.post("/v1/ocr", content=body, headers={"Content-Type": "Multipart/Form-Data; boundary=XyZ"})
        assert form.status_code in (200, 202), form.text
        batch = c.post("/v1/ocr/batch", content=body, headers={"Content-Type": "MULTIPART/form-data; boundary=XyZ"})
        assert batch.status_code in (200, 202), batch.text
        assert [it["filename"] for it in batch.json()["items"]] == ["c.png"]


@pytest.mark.parametrize("rid", [".", "..", "..."])
def test_a_request_id_of_dots_only_is_refused(api, rid):
    with httpx.Client(base_url=api.url, timeout=90) as c:
        r = c.post("/v1/ocr", content=text_image(["DOTS"]), params={"request_id": rid},
                   headers={"Content-Type": "image/png"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_request" and "request_id" in r.json()["error"]["message"]
