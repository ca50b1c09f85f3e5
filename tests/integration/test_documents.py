"""Documents: a PDF split into pages at ingest, read by two infer processes, assembled by the sink."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
import uuid

import pytest

from schemas.errors import ErrorCode
from schemas.events import DocumentResult
from schemas.ids import page_request_id
from services.common.settings import CommonSettings
from tests.attacks import miscounted_pdf
from tests.conftest import text_image
from tests.documents import make_pdf, page_image, s3_count, s3_get, submit_and_watch, tiff_with_broken_page
from tests.stack import REPO, TEST_ENV, Pipeline, db_rows, env_applied, metric_value, namespace_env

INFER_MAX_PIXELS = 1_000_000  # infer's own page limit: a larger page fails there (the page made to fail)
ENV = {"OCRSTREAM_LIMITS__MAX_DOCUMENT_PAGES": "50", "OCRSTREAM_LIMITS__MAX_DOCUMENT_PIXELS": "8000000"}
TERMS = "TERMS PAGE 77"  # printed on two pages: one page image, computed once
TERMS_AT = (7, 29)


def page_text(n: int) -> str:
    return TERMS if n in TERMS_AT else f"DOC PAGE {n:02d}"


@pytest.fixture(scope="module")
def doc_pipeline(stack_env, tmp_path_factory):
    """A pipeline of its own with TWO infer processes; infer refuses pages over 1 Mpx."""
    env = {**namespace_env(partitions=4), **TEST_ENV, **ENV}
    with env_applied(env):
        subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=REPO, check=True, capture_output=True)
        p = Pipeline(env=env, logdir=tmp_path_factory.mktemp("doc-logs"))
        try:
            for name in ("ingest", "dedup", "sink"):
                p.start(name, wait_ready=False)
            infer_env = {"OCRSTREAM_LIMITS__MAX_PIXELS": str(INFER_MAX_PIXELS)}
            p.start("infer", extra_env=infer_env, wait_ready=False)
            p.start("infer", extra_env=infer_env, wait_ready=False)
            for sts in p.stages.values():
                for st in sts:
                    p.wait_ready(st)
            yield p
        finally:
            p.stop_all()


def engine_calls_per_process(p: Pipeline) -> list[float]:
    out = []
    for st in p.stages["infer"]:
        with urllib.request.urlopen(f"http://127.0.0.1:{st.port}/metrics", timeout=5) as r:
            out.append(metric_value(r.read().decode(), "ocrstream_engine_images_total"))
    return out


async def test_forty_page_pdf_is_read_in_order_across_two_infers(doc_pipeline):
    pdf = make_pdf([page_image(page_text(n)) for n in range(1, 41)])
    before = engine_calls_per_process(doc_pipeline)
    rid, seen = await submit_and_watch(pdf, "contract.pdf", pages=40)
    doc = seen[-1].result
    after = engine_calls_per_process(doc_pipeline)

    assert doc.status == "ok", doc.error
    expected = [page_text(n) for n in range(1, 41)]
    assert doc.text == "\n\n".join(expected)
    assert [ln.text for ln in doc.lines] == expected and [ln.page for ln in doc.lines] == list(range(1, 41))
    assert [pg.index for pg in doc.pages] == list(range(1, 41))
    assert (doc.document_id, doc.page_count, doc.page_number, doc.failed_pages) == (rid, 40, None, [])
    assert doc.result_uri == f"s3://{CommonSettings().s3.bucket}/documents/{rid}.json"
    # the identical pages were computed once; both infer processes read pages
    calls = [a - b for a, b in zip(after, before)]
    assert sum(calls) == 39 and all(c > 0 for c in calls), calls
    # every page's own completion is on ocr.completed too, once each; the document's once
    pages = [ev.result for ev in seen if ev.result.document_id == rid and ev.result.page_number is not None]
    assert sorted(p.page_number for p in pages) == list(range(1, 41))
    assert {p.request_id for p in pages} == {page_request_id(rid, n) for n in range(1, 41)}
    assert [ev.request_id for ev in seen].count(rid) == 1
    # the whole document in S3, in page order, each page pointing at its own result
    whole = DocumentResult.model_validate_json(s3_get(f"documents/{rid}.json"))
    assert [pg.page_number for pg in whole.pages] == list(range(1, 41))
    assert [pg.text for pg in whole.pages] == expected and whole.text == doc.text
    assert all(pg.result_uri and pg.result_uri.startswith("s3://") for pg in whole.pages)
    assert whole.pages[6].content_sha256 == whole.pages[28].content_sha256
    assert len({pg.content_sha256 for pg in whole.pages}) == 39
    # per-page state in MariaDB, exact
    [row] = db_rows("SELECT page_count, completed_by, status FROM documents WHERE document_id = %s", rid)
    assert row["page_count"] == 40 and row["status"] == "ok" and row["completed_by"] is not None
    [n] = db_rows("SELECT COUNT(*) AS n, SUM(status = 'ok') AS ok FROM document_pages WHERE document_id = %s", rid)
    assert (n["n"], int(n["ok"])) == (40, 40)
    [req] = db_rows("SELECT status, line_count FROM requests WHERE request_id = %s", rid)
    assert (req["status"], req["line_count"]) == ("ok", 40)
    # its progress from the CLI
    res = subprocess.run([sys.executable, "-m", "services.cli", "status", rid], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == f"{rid}: 40/40 pages final (0 failed); ok, {doc.result_uri}"


async def test_a_failed_page_leaves_the_document_partial_naming_it(doc_pipeline):
    texts = ["DOC PAGE 91", "DOC PAGE 92", "DOC PAGE 93", "DOC PAGE 94"]
    pages = [page_image(t) for t in texts]
    pages[2] = page_image(texts[2], size=(1600, 1200))  # 1.92 Mpx: over infer's page limit
    rid, seen = await submit_and_watch(make_pdf(pages), "partial.pdf", pages=4)
    doc = seen[-1].result
    assert doc.status == "partial" and doc.error is None
    assert doc.failed_pages == [3]
    assert doc.text == "DOC PAGE 91\n\nDOC PAGE 92\n\nDOC PAGE 94"
    whole = DocumentResult.model_validate_json(s3_get(f"documents/{rid}.json"))
    assert [pg.status for pg in whole.pages] == ["ok", "ok", "error", "ok"]
    assert whole.pages[2].error.code is ErrorCode.IMAGE_TOO_LARGE and whole.failed_pages == [3]
    [failed] = [ev.result for ev in seen if ev.result.request_id == page_request_id(rid, 3)]
    assert failed.status == "error" and failed.error.code is ErrorCode.IMAGE_TOO_LARGE
    [req] = db_rows("SELECT status FROM requests WHERE request_id = %s", rid)
    assert req["status"] == "partial"


async def test_a_page_that_cannot_be_decoded_fails_alone_and_the_others_are_read(doc_pipeline):
    texts = [f"TIFF PAGE {n}" for n in range(1, 6)]
    tiff = tiff_with_broken_page([page_image(t) for t in texts], broken=3)  # its strips do not inflate
    rid, seen = await submit_and_watch(tiff, "scan.tiff", pages=5)
    doc = seen[-1].result
    assert (doc.status, doc.error, doc.failed_pages, doc.page_count) == ("partial", None, [3], 5)
    assert doc.text == "TIFF PAGE 1\n\nTIFF PAGE 2\n\nTIFF PAGE 4\n\nTIFF PAGE 5"
    # the page's own final state: its code, from ingest (it has no image: never announced to infer)
    [failed] = [ev.result for ev in seen if ev.result.request_id == page_request_id(rid, 3)]
    assert (failed.status, failed.error.code, failed.document_id, failed.page_number) == (
        "error", ErrorCode.CORRUPT_IMAGE, rid, 3)
    assert failed.error.message.startswith("TIFF page 3 could not be decoded: ") and failed.content_sha256 is None
    whole = DocumentResult.model_validate_json(s3_get(f"documents/{rid}.json"))
    assert [pg.status for pg in whole.pages] == ["ok", "ok", "error", "ok", "ok"]
    assert [pg.text for pg in whole.pages] == [*texts[:2], "", *texts[3:]]
    assert whole.pages[2].error.code is ErrorCode.CORRUPT_IMAGE and whole.failed_pages == [3]
    assert db_rows("SELECT page_number, status, error_code FROM document_pages WHERE document_id = %s"
                   " ORDER BY page_number", rid) == [
        {"page_number": n, "status": "error" if n == 3 else "ok", "error_code": "corrupt_image" if n == 3 else None}
        for n in range(1, 6)]
    [row] = db_rows("SELECT status, completed_by FROM documents WHERE document_id = %s", rid)
    assert row["status"] == "partial" and row["completed_by"] is not None


async def test_a_replayed_document_ends_the_same_bytes_once_more(doc_pipeline):
    pdf = make_pdf([page_image(t) for t in ("DOC PAGE 81", "DOC PAGE 82", "DOC PAGE 83")])
    rid, first = await submit_and_watch(pdf, "replay.pdf", pages=3,
                                        request_id=f"replayed-document-{uuid.uuid4().hex[:8]}")
    stored = s3_get(f"documents/{rid}.json")
    # the same submission again (an upstream producer's retry): the split announces the same page
    # requests, which end as they did; the document's completion comes again, the same bytes
    _, again = await submit_and_watch(pdf, "replay.pdf", pages=3, request_id=rid)
    assert again[-1].model_dump_json() == first[-1].model_dump_json()
    assert first[-1].result.status == "ok" and first[-1].result.text == "DOC PAGE 81\n\nDOC PAGE 82\n\nDOC PAGE 83"
    assert s3_get(f"documents/{rid}.json") == stored
    [row] = db_rows("SELECT COUNT(*) AS n FROM document_pages WHERE document_id = %s", rid)
    assert row["n"] == 3
    assert [ev.request_id for ev in again].count(rid) == 1


@pytest.mark.parametrize("count", [1, 5])
async def test_a_pdf_whose_count_says_otherwise_is_read_page_by_page_of_its_tree(doc_pipeline, count):
    """/Count 1 over 3 pages was one page (pages 2 and 3 dropped, no warning); /Count 5 over 3
    failed whole ("PDF page 4 could not be read"): each is now its 3 pages, in order."""
    texts = [f"TREE PAGE {count}{n}" for n in range(1, 4)]
    pdf = miscounted_pdf(make_pdf([page_image(t) for t in texts]), count)
    rid, seen = await submit_and_watch(pdf, f"count-{count}.pdf", pages=3)
    doc = seen[-1].result
    assert (doc.status, doc.error, doc.page_count, doc.failed_pages) == ("ok", None, 3, []), doc.error
    assert doc.text == "\n\n".join(texts)
    assert db_rows("SELECT page_number, status FROM document_pages WHERE document_id = %s ORDER BY page_number",
                   rid) == [{"page_number": n, "status": "ok"} for n in (1, 2, 3)]


@pytest.mark.parametrize("kind", ["pages", "pixels"])
async def test_documents_over_the_limits_are_refused_before_rendering(doc_pipeline, kind):
    if kind == "pages":  # 51 pages, limit 50
        pdf, code = make_pdf([page_image(f"P {n}") for n in range(51)]), ErrorCode.DOCUMENT_TOO_MANY_PAGES
    else:  # 5 x 1.92 Mpx = 9.6 Mpx, limit 8 Mpx (each page under the page limit)
        pdf, code = make_pdf([page_image(f"BIG {n}", size=(1600, 1200)) for n in range(5)]), ErrorCode.DOCUMENT_TOO_LARGE
    images = s3_count("images/")
    rid, seen = await submit_and_watch(pdf, f"over-{kind}.pdf")
    doc = seen[-1].result
    assert doc.status == "error" and doc.error.code is code, doc.error
    assert [ev.request_id for ev in seen] == [rid]  # no page was announced
    assert s3_count("images/") == images  # nothing rendered, nothing stored
    assert db_rows("SELECT * FROM documents WHERE document_id = %s", rid) == []
    nxt = text_image([f"AFTER {kind.upper()} 9"])
    _, after = await submit_and_watch(nxt, "next.png")
    assert after[-1].result.status == "ok" and after[-1].result.text == f"AFTER {kind.upper()} 9", after[-1].result.error
