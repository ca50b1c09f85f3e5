"""Edges of documents at the HTTP door: request ids that name a document's pages, which no claim
holds (ingest's split names them), are refused as any taken id (409 ``request_id_conflict``)."""

from __future__ import annotations

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


def test_a_page_id_of_a_finished_document_is_refused_not_answered_with_that_page(client):
    """Before: a PDF (or an image) posted with ``request_id=<doc>:p3`` was accepted (202) and its
    id then answered with the other document's page 3 (the first final state is kept)."""
    u = time.time_ns()
    doc = f"edge-doc-{u}"
    r = client.post("/v1/ocr", content=make_pdf([page_image(f"EDGE DOC {n}") for n in (1, 2, 3)]), headers=PDF,
                    params={"request_id": doc})
    assert r.status_code == 202, r.text
    assert wait_result(client, doc)["status"] == "ok"
    other = make_pdf([page_image(f"EDGE OTHER {n}") for n in (1, 2)])
    r = client.post("/v1/ocr", content=other, headers=PDF, params={"request_id": f"{doc}:p3"})
    assert (r.status_code, r.json()["error"]) == (409, {
        "code": "request_id_conflict",
        "message": f"request_id '{doc}:p3' is already used by another request (it has its final state); "
                   "choose a new request_id"})
    r = client.post("/v1/ocr", content=png(f"EDGE IMAGE {u}"), headers={"Content-Type": "image/png"},
                    params={"request_id": f"{doc}:p2"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "request_id_conflict", r.text
    # nothing was claimed, and the page keeps its own result
    assert db_rows("SELECT request_id FROM request_claims WHERE request_id IN (%s, %s)", f"{doc}:p3", f"{doc}:p2") == []
    page = client.get(f"/v1/ocr/{doc}:p3").json()
    assert (page["status"], page["result"]["text"], page["result"]["document_id"]) == ("ok", "EDGE DOC 3", doc)
    # an id merely of the page form, of no document, is a document's own id as any
    lone = f"edge-lone-{u}:p1"
    r = client.post("/v1/ocr", content=other, headers=PDF, params={"request_id": lone})
    assert r.status_code == 202, r.text
    body = wait_result(client, lone)
    assert (body["status"], body["result"]["document_id"], body["result"]["text"]) == (
        "ok", lone, "EDGE OTHER 1\n\nEDGE OTHER 2")


def test_a_page_id_of_a_document_in_flight_is_refused(client):
    """The page has no final state yet: the registered document's page count says it is taken."""
    u = time.time_ns()
    doc = f"edge-fly-{u}"
    r = client.post("/v1/ocr", content=make_pdf([page_image(f"EDGE FLY {u % 1000} {n}") for n in (1, 2)]),
                    headers=PDF, params={"request_id": doc})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 30
    while not db_rows("SELECT 1 FROM documents WHERE document_id = %s", doc):
        assert time.monotonic() < deadline, "the document was never registered"
        time.sleep(0.05)
    r = client.post("/v1/ocr", content=png(f"EDGE FLY IMAGE {u}"), headers={"Content-Type": "image/png"},
                    params={"request_id": f"{doc}:p2"})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "request_id_conflict"
    assert r.json()["error"]["message"] in (
        f"request_id '{doc}:p2' is page 2 of the document '{doc}'; choose a new request_id",
        # the page may already be final on a fast stack
        f"request_id '{doc}:p2' is already used by another request (it has its final state); choose a new request_id")
    # a page number past the document's is not a page of it
    r = client.post("/v1/ocr", content=png(f"EDGE FLY P3 {u}"), headers={"Content-Type": "image/png"},
                    params={"request_id": f"{doc}:p3"})
    assert r.status_code == 202, r.text
    body = wait_result(client, doc)
    assert (body["status"], body["result"]["page_count"]) == ("ok", 2)


def test_a_doc_parse_document_answers_with_its_pages_markdown_and_so_does_its_repeat(client):
    """Before: the document's answer (and the cached repeat's) had ``markdown`` null; only each
    page's own answer (``<id>:p<n>``) had it."""
    u = time.time_ns() % 10**6
    texts = [f"EDGE PARSE {u} {n}" for n in (1, 2)]
    pdf = make_pdf([page_image(t) for t in texts])
    r = client.post("/v1/ocr", content=pdf, headers=PDF, params={"task": "doc_parse"})
    assert r.status_code == 202, r.text
    body = wait_result(client, r.json()["request_id"])
    want = "\n\n".join(f"# {t}" for t in texts)
    assert (body["status"], body["result"]["markdown"], body["result"]["text"]) == ("ok", want, want), body
    assert (body["result"]["html"], body["result"]["fields"]) == (None, None)
    again = client.post("/v1/ocr", content=pdf, headers=PDF, params={"task": "doc_parse"})
    assert again.status_code == 200, again.text
    hit = again.json()["result"]
    assert (hit["cache_hit"], hit["page_count"], hit["markdown"], hit["text"]) == (True, 2, want, want)
