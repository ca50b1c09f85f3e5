"""Edges of documents at the HTTP door: a document page's id (``<doc>:p<n>``, ingest's split gives
them) can be read but never chosen (400 ``invalid_request``; Kafka: ``invalid_request`` under the
derived id), whichever comes first; a document's own answer and its cached repeat."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import pytest

from tests.documents import make_pdf, page_image
from tests.integration.test_http_documents import wait_result
from tests.stack import db_rows

pytestmark = pytest.mark.stack

PDF = {"Content-Type": "application/pdf"}


@pytest.fixture(scope="module")
def client(api):
    with httpx.Client(base_url=api.url, timeout=90) as c:
        yield c


def png(text: str) -> bytes:
    buf = io.BytesIO()
    page_image(text).save(buf, "PNG")
    return buf.getvalue()


PAGE_FORM = ("has the form of a document page's id (<document id>:p<page>), which ocrstream gives the pages it "
             "splits; choose an id that does not end in ':p' and digits")


def _page_id_refused(client, rid: str, data: bytes, headers: dict) -> None:
    r = client.post("/v1/ocr", content=data, headers=headers, params={"request_id": rid})
    assert (r.status_code, r.json()["error"]) == (400, {"code": "invalid_request",
                                                        "message": f"request_id: Value error, {PAGE_FORM}"}), r.text


async def _kafka_page_id_refused(rid: str, data: bytes) -> None:
    """A Kafka submission choosing ``rid`` ends ``invalid_request`` under its derived id."""
    from services.common.results.completions import CompletionWatcher
    from services.common.settings import CommonSettings
    from tests.stack import db_rows as rows

    s = CommonSettings()
    watcher = CompletionWatcher(s)
    await watcher.start()
    try:
        from schemas.events import SubmitEvent
        from services.common.codec import dumps
        from services.common.kafka import make_producer

        producer = make_producer(s.kafka, "test-page-ids")
        await producer.start()
        try:
            ev = SubmitEvent.model_construct(request_id=rid, image_b64=base64.b64encode(data).decode(),
                                             filename="forged.png")
            await producer.send_and_wait(s.topics.submit, dumps(ev), key=rid.encode())
        finally:
            await producer.stop()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = rows("SELECT request_id, status, error_code, error_message FROM requests WHERE error_message LIKE %s",
                       f"%{rid}%")
            if got:
                [row] = got
                assert (row["status"], row["error_code"]) == ("error", "invalid_request") and row["request_id"] != rid
                assert PAGE_FORM in row["error_message"]
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"the submission choosing {rid} never ended")
    finally:
        await watcher.stop()


def test_no_submission_may_choose_a_page_id_before_or_after_its_document(client):
    """A page id (``<doc>:p<n>``) is the system's alone. Before: an image submitted as ``D:p2``
    before the PDF ``D`` was split kept the claim and was answered with the PDF's page 2 (its own
    result lost); one submitted after was refused only while the page was known. Now either
    order, either door: the submission choosing the page id is refused at once (HTTP 400, Kafka
    ``invalid_request`` under its derived id), and the document's pages are its own."""
    u = time.time_ns()
    image = png(f"EDGE IMAGE {u}")
    first, then = f"edge-first-{u}", f"edge-then-{u}"
    # the image (as page 2 of a document not yet submitted), at both doors, then the document
    _page_id_refused(client, f"{first}:p2", image, {"Content-Type": "image/png"})
    asyncio.run(_kafka_page_id_refused(f"{first}:p2", image))
    for doc in (first, then):
        r = client.post("/v1/ocr", content=make_pdf([page_image(f"EDGE {doc[5:10]} {n}") for n in (1, 2, 3)]),
                        headers=PDF, params={"request_id": doc})
        assert r.status_code == 202, r.text
    # ... and after: the documents in flight or finished
    _page_id_refused(client, f"{then}:p2", image, {"Content-Type": "image/png"})
    asyncio.run(_kafka_page_id_refused(f"{then}:p3", image))
    for doc in (first, then):
        body = wait_result(client, doc)
        assert (body["status"], body["result"]["page_count"]) == ("ok", 3)
        for n in (2, 3):
            page = client.get(f"/v1/ocr/{doc}:p{n}").json()
            assert (page["status"], page["result"]["text"], page["result"]["document_id"]) == (
                "ok", f"EDGE {doc[5:10]} {n}", doc)
    assert db_rows("SELECT request_id FROM request_claims WHERE request_id IN (%s, %s, %s)",
                   f"{first}:p2", f"{then}:p2", f"{then}:p3") == []
    # a page number past the document's, or an id of the page form of no document: the form is refused
    _page_id_refused(client, f"{then}:p9", image, {"Content-Type": "image/png"})
    _page_id_refused(client, f"edge-lone-{u}:p1", make_pdf([page_image("EDGE LONE")]), PDF)
    # an id that only looks close is anyone's
    r = client.post("/v1/ocr", content=image, headers={"Content-Type": "image/png"},
                    params={"request_id": f"edge-near-{u}:p2a"})
    assert r.status_code in (200, 202), r.text


def test_a_doc_parse_document_answers_with_its_pages_markdown_and_so_does_its_repeat(client):
    """Before: the document's answer (and the cached repeat's) had ``markdown`` null; only each
    page's own answer (``<id>:p<n>``) had it."""
    texts = ["EDGE PARSE 314159 1", "EDGE PARSE 314159 2"]  # fixed: the namespace is new each run
    pdf = make_pdf([page_image(t) for t in texts])
    r = client.post("/v1/ocr", content=pdf, headers=PDF, params={"task": "doc_parse"})
    assert r.status_code == 202, r.text
    rid = r.json()["request_id"]
    body = wait_result(client, rid)
    # the document's markdown is its pages' own, in order (whether the layout model calls a line a
    # title, "# ...", or text is the model's business, not this test's)
    pages = [client.get(f"/v1/ocr/{rid}:p{n}").json()["result"]["markdown"] for n in (1, 2)]
    assert [m.removeprefix("# ") for m in pages] == texts, pages
    want = "\n\n".join(pages)
    assert (body["status"], body["result"]["markdown"], body["result"]["text"]) == ("ok", want, want), body
    assert (body["result"]["html"], body["result"]["fields"]) == (None, None)
    again = client.post("/v1/ocr", content=pdf, headers=PDF, params={"task": "doc_parse"})
    assert again.status_code == 200, again.text
    hit = again.json()["result"]
    assert (hit["cache_hit"], hit["page_count"], hit["markdown"], hit["text"]) == (True, 2, want, want)
