"""Documents posted to the HTTP door: stored by the door, split by ingest, assembled by the sink,
answered by the door's long-poll as the document; over-limit documents refused early; forged door marks refused."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from PIL import Image

from schemas.events import SubmitEvent
from schemas.keys import image_object_key
from services.cli.client import Submitter
from services.common.codec import derived_request_id, dumps
from services.common.settings import CommonSettings
from tests.integration.conftest import API_ENV
from tests.documents import make_pdf, page_image
from tests.integration.test_http_events import sse
from tests.integration.test_http_webhooks import Receiver
from tests.stack import API, REPO, db_rows

pytestmark = pytest.mark.stack

PDF_TEXTS = [f"DOC PAGE {n:02d}" for n in (1, 2, 3, 4)]
TIFF_TEXTS = [f"TIFF PAGE {n:02d}" for n in (1, 2, 3)]
#: The second door: API keys required, 200 pages per document (ingest: 3,000) and 13 Gpx per document
#: (ingest: 12 Gpx), so one document is refused by the door and another only by ingest.
KEYED_DOOR_ENV = {**API_ENV, "OCRSTREAM_AUTH_REQUIRED": "true", "OCRSTREAM_LIMITS__MAX_DOCUMENT_PAGES": "200",
                  "OCRSTREAM_LIMITS__MAX_DOCUMENT_PIXELS": "13000000000"}


def make_tiff(pages: list[Image.Image]) -> bytes:
    buf = io.BytesIO()
    pages[0].save(buf, "TIFF", save_all=True, append_images=pages[1:], compression="tiff_lzw")
    return buf.getvalue()


def blank_pages_pdf(n: int, side: int) -> bytes:
    """A PDF of ``n`` blank ``side`` x ``side`` px pages at 200 dpi, a few hundred bytes each (a
    10 px image placed at a low resolution): page counts and pixel totals for the limits, nothing to read."""
    img = Image.new("L", (10, 10), 255)
    buf = io.BytesIO()
    img.save(buf, "PDF", save_all=True, append_images=[img.copy() for _ in range(n - 1)], resolution=10 * 200 / side)
    return buf.getvalue()


def wait_result(c: httpx.Client, rid: str, timeout: float = 75) -> dict:
    """The request's answer once it is final (long-polls of up to 30 s)."""
    deadline = time.monotonic() + timeout
    while True:
        got = c.get(f"/v1/ocr/{rid}", params={"wait": 30})
        assert got.status_code == 200, got.text
        body = got.json()
        if body["status"] != "pending" or time.monotonic() > deadline:
            return body


@pytest.fixture(scope="module")
def client(api):
    with httpx.Client(base_url=api.url, timeout=90) as c:
        yield c


@pytest.fixture(scope="module")
def keyed_door(pipeline):
    """The second door and a key made by ``ocrstream keys create``: ``(client sending the key, key id)``."""
    out = subprocess.run([sys.executable, "-m", "services.cli", "keys", "create", "--name", f"doc-{time.time_ns()}",
                          "--rate", "0"], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, COLUMNS="200"), timeout=60)
    assert out.returncode == 0, out.stderr
    fields = dict(re.findall(r"^(\w+):\s+(\S+)$", out.stdout, re.M))
    st = pipeline.start(API, extra_env=KEYED_DOOR_ENV)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{st.port}", timeout=90,
                          headers={"X-API-Key": fields["api_key"]}) as c:
            yield c, fields["key_id"]
    finally:
        pipeline.stop(st)
        db_rows("DELETE FROM api_keys WHERE key_id = %s", fields["key_id"])


@pytest.fixture(scope="module")
def pdf_done(client):
    """A 4-page PDF posted raw, and its long-polled document answer: ``(rid, body, pdf bytes)``."""
    pdf = make_pdf([page_image(t) for t in PDF_TEXTS])
    r = client.post("/v1/ocr", content=pdf, headers={"Content-Type": "application/pdf"},
                    params={"filename": "four.pdf", "source": "web"})
    assert r.status_code == 202, r.text
    rid = r.json()["request_id"]
    return rid, wait_result(client, rid), pdf


def test_pdf_over_http_is_split_and_answered_as_the_document(pdf_done):
    rid, body, pdf = pdf_done
    assert body["status"] == "ok", body
    doc = body["result"]
    assert doc["request_id"] == rid and doc["document_id"] == rid
    assert doc["page_count"] == 4 and doc["failed_pages"] == [] and doc["page_number"] is None
    assert doc["text"] == "\n\n".join(PDF_TEXTS)
    assert [p["index"] for p in doc["pages"]] == [1, 2, 3, 4]
    assert [ln["page"] for ln in doc["lines"]] == [1, 2, 3, 4]
    assert doc["content_sha256"] == hashlib.sha256(pdf).hexdigest()
    assert doc["filename"] == "four.pdf" and doc["source"] == "web"
    assert doc["result_uri"].endswith(f"/documents/{rid}.json")
    # the pages went through ingest's split: one request each, under <rid>:p<n>
    rows = db_rows("SELECT page_number, status FROM document_pages WHERE document_id = %s ORDER BY page_number", rid)
    assert [(r["page_number"], r["status"]) for r in rows] == [(1, "ok"), (2, "ok"), (3, "ok"), (4, "ok")]


def test_multipage_tiff_in_a_multipart_upload_is_split_and_its_webhook_is_the_documents(client):
    tiff = make_tiff([page_image(t) for t in TIFF_TEXTS])
    rid = f"tiff-{time.time_ns()}"  # chosen by the client: claimed once, by the door
    with Receiver([200]) as rcv:
        r = client.post("/v1/ocr", files={"file": ("three.tif", tiff, "image/tiff")},
                        data={"request_id": rid, "callback_url": f"{rcv.url}/hook"})
        assert r.status_code == 202, r.text
        assert r.json()["request_id"] == rid
        body = wait_result(client, rid)
        assert body["status"] == "ok", body
        doc = body["result"]
        assert doc["document_id"] == rid and doc["page_count"] == 3 and doc["failed_pages"] == []
        assert doc["text"] == "\n\n".join(TIFF_TEXTS)
        assert doc["filename"] == "three.tif"
        # one webhook, the document's (its pages carry no callback)
        deadline = time.monotonic() + 30
        while not rcv.hits and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)
    assert len(rcv.hits) == 1
    ev = json.loads(rcv.hits[0]["body"])
    assert ev["request_id"] == rid and ev["result"]["page_number"] is None and ev["result"]["page_count"] == 3
    assert ev["result"]["text"] == "\n\n".join(TIFF_TEXTS)
    # a resend with the same id is idempotent: the finished document, not a second split
    again = client.post("/v1/ocr", files={"file": ("three.tif", tiff, "image/tiff")}, data={"request_id": rid})
    assert again.status_code == 200 and again.json()["result"]["document_id"] == rid


def test_repeat_upload_is_answered_from_the_cache(client, pdf_done):
    """The sink cached the ok document under the file's key: the same file is a cache hit at the door."""
    first, body, pdf = pdf_done
    r = client.post("/v1/ocr", content=pdf, headers={"Content-Type": "application/pdf"})
    assert r.status_code == 200, r.text
    hit = r.json()
    assert hit["status"] == "ok" and hit["cache_hit"] is True and hit["request_id"] != first
    assert hit["result"]["text"] == "\n\n".join(PDF_TEXTS)
    assert hit["result"]["lines"] == body["result"]["lines"]
    assert [(p["index"], p["width"], p["height"]) for p in hit["result"]["pages"]] == [
        (p["index"], p["width"], p["height"]) for p in body["result"]["pages"]]
    assert hit["result"]["content_sha256"] == hashlib.sha256(pdf).hexdigest()
    # answered as the document it is
    doc = hit["result"]
    assert (doc["document_id"], doc["page_count"], doc["failed_pages"], doc["page_number"]) == (
        hit["request_id"], 4, [], None)
    # ... and still gets its row through the sink, as an image's hit does
    stored = wait_result(client, hit["request_id"])
    assert stored["status"] == "ok" and stored["result"]["cache_hit"] is True
    assert (stored["result"]["document_id"], stored["result"]["page_count"]) == (hit["request_id"], 4)


def test_another_file_of_the_same_pages_is_split_and_every_page_is_a_cache_hit(client, pdf_done, s3):
    """Another file (other bytes: a PDF title) of the same page images: no entry under its key, so
    it is split; each page is answered from the page cache (same renders, same hashes)."""
    pages = [page_image(t) for t in PDF_TEXTS]
    buf = io.BytesIO()
    pages[0].save(buf, "PDF", save_all=True, append_images=pages[1:], resolution=200.0, title="another file")
    other = buf.getvalue()
    assert other != pdf_done[2]
    r = client.post("/v1/ocr", content=other, headers={"Content-Type": "application/pdf"})
    assert r.status_code == 202, r.text
    rid = r.json()["request_id"]
    body = wait_result(client, rid)
    assert body["status"] == "ok", body
    assert body["result"]["text"] == "\n\n".join(PDF_TEXTS)
    stored = json.loads(s3.get_object(Bucket=s3.bucket, Key=f"documents/{rid}.json")["Body"].read())
    assert [(p["page_number"], p["cache_hit"]) for p in stored["pages"]] == [(1, True), (2, True), (3, True), (4, True)]


def test_batch_with_a_document_and_an_image(client):
    pdf = make_pdf([page_image(t) for t in PDF_TEXTS[:2]])
    png = io.BytesIO()
    page_image("LONE IMAGE").save(png, "PNG")
    r = client.post("/v1/ocr/batch", files=[("file", ("two.pdf", pdf, "application/pdf")),
                                            ("file", ("one.png", png.getvalue(), "image/png"))])
    assert r.status_code == 202, r.text
    doc_id, img_id = (it["request_id"] for it in r.json()["items"])
    with client.stream("GET", r.json()["links"]["events"] + "&timeout=60") as resp:
        assert resp.status_code == 200
        done = {ev["id"]: ev["data"] for ev in sse(resp) if ev.get("event") == "completed"}
    assert set(done) == {doc_id, img_id}  # one completion each: a page's own never reaches the stream
    doc, img = done[doc_id], done[img_id]
    assert doc["status"] == "ok" and doc["result"]["page_count"] == 2 and doc["result"]["text"] == "\n\n".join(PDF_TEXTS[:2])
    assert doc["result"]["page_number"] is None
    assert img["status"] == "ok" and img["result"]["page_count"] is None and img["result"]["text"] == "LONE IMAGE"


def test_a_keyed_document_is_the_keys_pages_and_all(keyed_door):
    c, key_id = keyed_door
    pdf = make_pdf([page_image(t) for t in ("KEYED PAGE 01", "KEYED PAGE 02")])
    r = c.post("/v1/ocr", content=pdf, headers={"Content-Type": "application/pdf"})
    assert r.status_code == 202, r.text
    rid = r.json()["request_id"]
    body = wait_result(c, rid)
    assert body["status"] == "ok" and body["result"]["text"] == "KEYED PAGE 01\n\nKEYED PAGE 02", body
    assert body["result"]["api_key_id"] == key_id
    rows = db_rows("SELECT request_id, document_json FROM requests WHERE request_id IN (%s, %s, %s)"
                   " ORDER BY request_id", rid, f"{rid}:p1", f"{rid}:p2")
    assert [(row["request_id"], json.loads(row["document_json"])["api_key_id"]) for row in rows] == [
        (rid, key_id), (f"{rid}:p1", key_id), (f"{rid}:p2", key_id)]
    [claim] = db_rows("SELECT door, api_key_id, content_sha256 FROM request_claims WHERE request_id = %s", rid)
    assert claim == {"door": "http", "api_key_id": key_id, "content_sha256": hashlib.sha256(pdf).hexdigest()}
    # the same file again with the key: the document's cache entry answers it
    again = c.post("/v1/ocr", content=pdf, headers={"Content-Type": "application/pdf"})
    assert again.status_code == 200 and again.json()["cache_hit"] is True, again.text


def test_over_limit_documents_are_refused_at_the_door_or_end_with_ingests_code(keyed_door):
    c, _ = keyed_door
    pdf = {"Content-Type": "application/pdf"}
    r = c.post("/v1/ocr", content=blank_pages_pdf(201, 100), headers=pdf)
    assert (r.status_code, r.json()["error"]) == (413, {"code": "document_too_many_pages",
                                                        "message": "PDF has 201 pages, limit 200"})
    r = c.post("/v1/ocr", content=blank_pages_pdf(134, 9900), headers=pdf)  # 98 Mpx a page, 13.13 Gpx in all
    assert (r.status_code, r.json()["error"]) == (413, {
        "code": "document_too_large", "message": "the 134 pages hold 13133340000 pixels, limit 13000000000"})
    # 12.15 Gpx: within the door's 13, over ingest's 12: ingest refuses, and the caller reads its error
    r = c.post("/v1/ocr", content=blank_pages_pdf(124, 9900), headers=pdf)
    assert r.status_code == 202, r.text
    rid = r.json()["request_id"]
    body = wait_result(c, rid)
    assert body["status"] == "error" and body["error"] == {
        "code": "document_too_large", "message": "the 124 pages hold 12153240000 pixels, limit 12000000000"}, body
    assert db_rows("SELECT document_id FROM documents WHERE document_id = %s", rid) == []  # nothing was split


def test_a_forged_http_door_mark_on_kafka_is_refused(pdf_done):
    """A plain Kafka producer naming the door's request id under another API key, or an id the
    door never claimed, ends http_door_unverified under its derived id; the real request keeps its result."""
    rid, _, pdf = pdf_done
    s = CommonSettings()
    uri = f"s3://{s.s3.bucket}/{image_object_key(hashlib.sha256(pdf).hexdigest())}"

    async def send(ev: SubmitEvent) -> str:
        sub = Submitter(s)
        await sub.start()
        try:
            md = await sub.producer.send_and_wait(s.topics.submit, dumps(ev), key=b"forged")
        finally:
            await sub.stop()
        return derived_request_id(s.topics.submit, md.partition, md.offset)

    forged = [
        (SubmitEvent(request_id=rid, image_uri=uri, door="http", api_key_id="intruder"), "claimed it for another"),
        (SubmitEvent(request_id=f"never-{time.time_ns()}", image_uri=uri, door="http"), "is not claimed"),
    ]
    for ev, says in forged:
        derived = asyncio.run(send(ev))
        deadline = time.monotonic() + 60
        while not (rows := db_rows("SELECT status, document_json FROM requests WHERE request_id = %s", derived)):
            assert time.monotonic() < deadline, f"no final state for {derived}"
            time.sleep(0.5)
        result = json.loads(rows[0]["document_json"])
        assert rows[0]["status"] == "error" and result["error"]["code"] == "http_door_unverified"
        assert says in result["error"]["message"] and derived in result["error"]["message"]
        assert result["api_key_id"] is None
    [own] = db_rows("SELECT status FROM requests WHERE request_id = %s", rid)
    assert own["status"] == "ok"
