"""SIGKILL during documents: of the sink while a document's pages are recorded and assembled, of
ingest while it splits a PDF. The document is read once and completes once (docs/documents.md)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import signal
import time
import uuid

import pymysql
import pytest
from PIL import Image

from schemas.events import CompletedEvent, DocumentResult
from schemas.ids import page_request_id
from schemas.keys import image_object_key
from services.common.documents import state as documents
from services.common.db import Database
from services.common.results.rows import ResultRows
from services.common.codec import completion_event_id, dumps
from services.common.settings import CommonSettings
from services.common.documents.splitting import render_pages
from services.common.documents.assembly import _page_of, assemble
from tests.documents import completions_of, drained, make_pdf, page_image, s3_client, s3_count, s3_get, submit_and_watch
from tests.fault.conftest import FAULT_ENV
from tests.stack import Pipeline, db_rows, namespaced_pipeline, require_stack

SINK_PAGES = 16
SINK_KILL_AT = 5  # the sink is killed once this many pages are recorded, then again as the document completes
SPLIT_PAGES = 20
SPLIT_SCALE = 8  # each page drawn from a bilevel image 8x its rendered size: ~20 ms a page to render
#: Ingest renders and stores one page at a time (default 4): the split of SPLIT_PAGES takes ~0.8 s, not ~0.2 s
SPLIT_BATCH_PAGES = 1


@pytest.fixture(scope="module")
def doc_fault_pipeline(tmp_path_factory):
    """The fault pipeline (tests/fault/conftest.py) with ingest splitting one page at a time."""
    require_stack()
    extra = {**FAULT_ENV, "OCRSTREAM_SPLIT_BATCH_PAGES": str(SPLIT_BATCH_PAGES)}
    with namespaced_pipeline(tmp_path_factory.mktemp("doc-fault-logs"), extra) as p:
        yield p


def _kill_when(p: Pipeline, name: str, sql: str, args: tuple, done, bound_s: float = 120) -> float:
    """Poll ``sql`` on one MariaDB connection (about 1 ms a read) until ``done(row)``, then SIGKILL
    the live process of stage ``name``; the seconds it waited.

    Raises:
        AssertionError: ``done`` not reached within ``bound_s``.
    """
    c = CommonSettings().mysql
    conn = pymysql.connect(host=c.host, port=c.port, user=c.user, password=c.password.get_secret_value(),
                           database=c.database, autocommit=True, cursorclass=pymysql.cursors.DictCursor)
    t0 = time.monotonic()
    try:
        with conn.cursor() as cur:
            while time.monotonic() - t0 < bound_s:
                cur.execute(sql, args)
                if done(cur.fetchone()):
                    [st] = [x for x in p.stages[name] if x.proc.poll() is None]
                    p.stop(st, sig=signal.SIGKILL)
                    return time.monotonic() - t0
                time.sleep(0.001)
    finally:
        conn.close()
    raise AssertionError(f"{sql} {args}: not reached in {bound_s}s")


async def _expected_document(rid: str) -> bytes:
    """The document object a fresh assembly builds from the pages' final states MariaDB holds."""
    db = Database(CommonSettings().mysql, pool_size=1)
    doc, count = await documents.document_row(db, rid)
    numbered = await documents.page_requests(db, rid)
    held = await ResultRows(db).get_requests([r for _, r in numbered])
    finals = [held[r] for _, r in numbered]
    pages = [_page_of(n, f, f.lines) for (n, _), f in zip(numbered, finals)]
    return dumps(assemble(doc, count, pages, finals, 0.0))


def _check_rows(rid: str, n: int) -> None:
    """MariaDB's rows of a document read whole: its row, one page row each, its own final state."""
    [row] = db_rows("SELECT page_count, status, result_uri FROM documents WHERE document_id = %s", rid)
    assert row == {"page_count": n, "status": "ok",
                   "result_uri": f"s3://{CommonSettings().s3.bucket}/documents/{rid}.json"}
    assert db_rows("SELECT page_number, request_id, status, error_code FROM document_pages WHERE document_id = %s"
                   " ORDER BY page_number", rid) == [
        {"page_number": k, "request_id": page_request_id(rid, k), "status": "ok", "error_code": None}
        for k in range(1, n + 1)]
    assert db_rows("SELECT status, line_count FROM requests WHERE request_id = %s", rid) == [
        {"status": "ok", "line_count": n}]
    marks = ",".join(["%s"] * n)
    pages = db_rows(f"SELECT request_id, status FROM requests WHERE request_id IN ({marks})",
                    *(page_request_id(rid, k) for k in range(1, n + 1)))
    assert sorted((r["request_id"], r["status"]) for r in pages) == sorted(
        (page_request_id(rid, k), "ok") for k in range(1, n + 1))


async def _check_once(rid: str, n: int, texts: list[str]) -> dict[str, list[bytes]]:
    """The document ended ``ok`` with ``texts`` in page order; one distinct completion each for it
    and its pages, the document's the final state MariaDB holds; its S3 object the one a fresh
    assembly builds. Returns the raw completions per request id."""
    raws = await completions_of(rid, n)
    assert sorted(raws) == sorted([rid, *(page_request_id(rid, k) for k in range(1, n + 1))])
    assert {r: len(set(v)) for r, v in raws.items() if len(set(v)) != 1} == {}  # replays are byte-identical
    ev = CompletedEvent.model_validate_json(raws[rid][0])
    doc = ev.result
    assert ev.event_id == completion_event_id(rid) and (doc.page_number, doc.page_count) == (None, n)
    assert (doc.status, doc.failed_pages, doc.text) == ("ok", [], "\n\n".join(texts))
    assert [ln.page for ln in doc.lines] == list(range(1, n + 1)) and [ln.text for ln in doc.lines] == texts
    assert (await ResultRows(Database(CommonSettings().mysql, pool_size=1)).get_requests([rid]))[rid] == doc
    stored = s3_get(f"documents/{rid}.json")
    assert stored == await _expected_document(rid)
    whole = DocumentResult.model_validate_json(stored)
    assert [pg.page_number for pg in whole.pages] == list(range(1, n + 1)) and [pg.text for pg in whole.pages] == texts
    _check_rows(rid, n)
    return raws


async def test_sigkill_of_the_sink_mid_document_assembles_it_once(doc_fault_pipeline):
    p = doc_fault_pipeline
    texts = [f"SINK DOC {k:02d}" for k in range(1, SINK_PAGES + 1)]
    rid = f"sink-kill-{uuid.uuid4().hex[:10]}"
    started = time.monotonic()
    watch = asyncio.create_task(submit_and_watch(make_pdf([page_image(t) for t in texts]), "kill-sink.pdf",
                                                 pages=SINK_PAGES, request_id=rid, timeout=240))
    count = "SELECT COUNT(*) AS n FROM document_pages WHERE document_id = %s"
    await asyncio.to_thread(_kill_when, p, "sink", count, (rid,), lambda r: r["n"] >= SINK_KILL_AT)
    [first] = db_rows(count, rid)
    await asyncio.to_thread(p.start, "sink")
    # again the moment a page completes the document: in its assembly, its write, or just after
    completing = "SELECT completed_by FROM documents WHERE document_id = %s"
    await asyncio.to_thread(_kill_when, p, "sink", completing, (rid,), lambda r: r and r["completed_by"] is not None)
    at_second = db_rows("SELECT d.status, COUNT(r.request_id) AS held FROM documents d LEFT JOIN requests r"
                        " ON r.request_id = d.document_id WHERE d.document_id = %s GROUP BY d.status", rid)
    await asyncio.to_thread(p.start, "sink")
    await watch
    await drained(p.env["OCRSTREAM_SINK_GROUP_ID"], p.env["OCRSTREAM_TOPICS__RESULTS"])
    raws = await _check_once(rid, SINK_PAGES, texts)
    print(f"sink killed at {first['n']}/{SINK_PAGES} pages recorded, then as page completed it "
          f"(assembled, own row: {at_second}); {len(raws[rid])} copies of the document's completion; "
          f"{time.monotonic() - started:.1f}s; logs in {p.logdir}")
    assert SINK_KILL_AT <= first["n"] < SINK_PAGES  # the first kill landed while pages were still coming
    # killed before its own row was written (so before its completion was sent): the replay sent it once;
    # killed after: a second, byte-identical copy comes when the kill fell before the batch's commit
    assert len(raws[rid]) == 1 or at_second[0]["held"] == 1, (at_second, len(raws[rid]))


def _split_document() -> tuple[bytes, list[str], list[str]]:
    """A PDF of :data:`SPLIT_PAGES` pages each drawn from a bilevel image :data:`SPLIT_SCALE` times
    its rendered size (a slower render, the same text as a plain page); its texts; the object keys
    of its rendered pages (rendered here as ingest renders them: the same PNG bytes)."""
    texts = [f"SPLIT PAGE {k:02d}" for k in range(1, SPLIT_PAGES + 1)]
    images = []
    for t in texts:
        page = page_image(t).point(lambda v: 255 if v > 127 else 0, "1")
        images.append(page.resize((page.width * SPLIT_SCALE, page.height * SPLIT_SCALE), Image.NEAREST))
    buf = io.BytesIO()
    images[0].save(buf, "PDF", save_all=True, append_images=images[1:], resolution=200.0 * SPLIT_SCALE)
    pdf = buf.getvalue()
    keys = [image_object_key(hashlib.sha256(png).hexdigest()) for png, _, _ in render_pages(pdf, 0, SPLIT_PAGES, 10**8)]
    return pdf, texts, keys


def _stored(keys: list[str]) -> int:
    """How many of ``keys`` are in the bucket."""
    client, bucket = s3_client(), CommonSettings().s3.bucket
    return sum(client.list_objects_v2(Bucket=bucket, Prefix=key)["KeyCount"] for key in keys)


def _kill_when_stored(p: Pipeline, name: str, key: str, bound_s: float = 120) -> None:
    """List ``key`` in the bucket (a few ms a call) until it is there, then SIGKILL stage ``name``."""
    client, bucket = s3_client(), CommonSettings().s3.bucket
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if client.list_objects_v2(Bucket=bucket, Prefix=key)["KeyCount"]:
            [st] = [x for x in p.stages[name] if x.proc.poll() is None]
            p.stop(st, sig=signal.SIGKILL)
            return
    raise AssertionError(f"{key} not stored in {bound_s}s")


async def test_sigkill_of_ingest_mid_split_reads_every_page_once(doc_fault_pipeline):
    p = doc_fault_pipeline
    pdf, texts, keys = await asyncio.to_thread(_split_document)
    rid = f"split-kill-{uuid.uuid4().hex[:10]}"
    images, calls = s3_count("images/"), p.engine_calls()
    started = time.monotonic()
    watch = asyncio.create_task(submit_and_watch(pdf, "kill-ingest.pdf", pages=SPLIT_PAGES, request_id=rid,
                                                 timeout=240))
    await asyncio.to_thread(_kill_when_stored, p, "ingest", keys[0])  # its first page is stored
    # the kill landed mid-split: some pages stored, not all; the document not registered, nothing announced
    stored = await asyncio.to_thread(_stored, keys)
    assert 1 <= stored < SPLIT_PAGES, stored
    assert db_rows("SELECT document_id FROM documents WHERE document_id = %s", rid) == []
    await asyncio.to_thread(p.start, "ingest")
    await watch
    await drained(p.env["OCRSTREAM_SINK_GROUP_ID"], p.env["OCRSTREAM_TOPICS__RESULTS"])
    raws = await _check_once(rid, SPLIT_PAGES, texts)
    print(f"ingest killed with {stored}/{SPLIT_PAGES} pages stored; document read in "
          f"{time.monotonic() - started:.1f}s; logs in {p.logdir}")
    # every page read once, announced once: one completion each, no copy; the pages and the PDF stored once
    assert p.engine_calls() - calls == SPLIT_PAGES
    assert {r: len(v) for r, v in raws.items()} == {r: 1 for r in raws}
    assert s3_count("images/") - images == SPLIT_PAGES + 1
