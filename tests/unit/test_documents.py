"""Documents: the page checks before rendering, the split's pages, page ids and the assembly rules (pure logic)."""

from __future__ import annotations

import hashlib
import io

import pypdfium2
import pytest
from PIL import Image, ImageDraw

from schemas.errors import ErrorCode
from schemas.events import RequestEvent, ResultDocument
from schemas.ids import is_request_id, page_request_id
from schemas.reading import ErrorInfo, Line
from services.common.images.decoding import DecoderPool, DecoderStopped
from services.common.errors import OcrError
from services.common.images.imaging import decode
from services.common.settings import DecodeSettings, Limits
from services.common.documents.splitting import document_plan, render_pages
from services.common.documents.assembly import _page_of, assemble, document_status, summary
from tests.attacks import miscounted_pdf
from tests.conftest import CASES
from tests.documents import make_pdf, page_image, tiff_with_broken_page

BOX = [[0, 0], [10, 0], [10, 10], [0, 10]]


def pdf_of(n: int, size=(300, 100)) -> bytes:
    pages = []
    for i in range(n):
        img = Image.new("L", size, 255)
        ImageDraw.Draw(img).text((10, 10), f"PAGE {i}", fill=0)
        pages.append(img)
    buf = io.BytesIO()
    pages[0].save(buf, "PDF", save_all=True, append_images=pages[1:], resolution=200.0)
    return buf.getvalue()


@pytest.mark.parametrize("failed,rate,status", [
    (0, 0.0, "ok"), (1, 0.0, "partial"), (39, 0.0, "partial"), (40, 0.0, "error"),
    (2, 0.05, "partial"), (3, 0.05, "error"), (1, 1.0, "partial"), (40, 1.0, "error"),
])
def test_document_status_rule(failed, rate, status):
    assert document_status(40, failed, rate) == status


def test_page_request_ids_are_deterministic_and_valid():
    assert page_request_id("doc-7", 12) == "doc-7:p12"
    long = "x" * 64
    pid = page_request_id(long, 3000)
    assert pid == hashlib.sha256(long.encode()).hexdigest()[:40] + ":p3000"
    assert is_request_id(pid) and is_request_id(page_request_id("doc-7", 1))


def test_pdf_page_count_and_pixels_are_checked_before_rendering():
    pdf = pdf_of(5)
    info, sizes = document_plan(pdf, 10**8, 2, 3000, 10**9)
    assert (info.format, info.frames, sizes) == ("PDF", 5, [(300, 100)] * 5)
    with pytest.raises(OcrError) as e:
        document_plan(pdf, 10**8, 2, 4, 10**9)
    assert e.value.code is ErrorCode.DOCUMENT_TOO_MANY_PAGES and "5 pages, limit 4" in e.value.message
    with pytest.raises(OcrError) as e:
        document_plan(pdf, 10**8, 2, 3000, 149_999)
    assert e.value.code is ErrorCode.DOCUMENT_TOO_LARGE and "150000 pixels, limit 149999" in e.value.message
    # a page over the page limit fails alone when it would be rendered: not counted, not refused here
    assert document_plan(pdf, 29_999, 2, 3000, 1)[1] == [(300, 100)] * 5
    with pytest.raises(OcrError) as e:  # a one-page PDF is one request: refused as any image
        document_plan(pdf_of(1), 29_999, 2, 3000, 10**9)
    assert e.value.code is ErrorCode.IMAGE_TOO_LARGE


@pytest.mark.parametrize("count", [1, 5])
def test_a_pdf_is_the_pages_its_tree_holds_whatever_its_count_says(count):
    pdf = pdf_of(3)
    bad = miscounted_pdf(pdf, count)
    assert len(pypdfium2.PdfDocument(bad)) == count  # PDFium alone: /Count as it stands
    info, sizes = document_plan(bad, 10**8, 2, 3000, 10**9)
    assert (info.frames, sizes) == (3, [(300, 100)] * 3)
    assert list(render_pages(bad, 0, 3, 10**8)) == list(render_pages(pdf, 0, 3, 10**8))
    assert [p.shape for p in decode(bad, 10**8, 5)] == [(100, 300, 3)] * 3  # the one-request path too
    with pytest.raises(OcrError) as e:  # the tree's count meets the limits
        document_plan(miscounted_pdf(pdf_of(5), 1), 10**8, 2, 4, 10**9)
    assert e.value.code is ErrorCode.DOCUMENT_TOO_MANY_PAGES and "5 pages, limit 4" in e.value.message


def test_tiff_pages_are_walked_to_the_document_limit_only():
    tiff = (CASES / "img16_multipage.tiff").read_bytes()
    info, sizes = document_plan(tiff, 10**8, 1, 3000, 10**9)
    assert (info.format, info.frames, sizes) == ("TIFF", 3, [(1240, 600)] * 3)
    with pytest.raises(OcrError) as e:
        document_plan(tiff, 10**8, 20, 2, 10**9)
    assert e.value.code is ErrorCode.DOCUMENT_TOO_MANY_PAGES


def test_rendered_pages_are_pngs_the_same_every_time():
    pdf = pdf_of(3)
    first = list(render_pages(pdf, 1, 5, 10**8))
    assert [(w, h) for _, w, h in first] == [(300, 100), (300, 100)]
    assert all(png.startswith(b"\x89PNG") for png, _, _ in first)
    assert list(render_pages(pdf, 1, 5, 10**8)) == first
    tiff = (CASES / "img16_multipage.tiff").read_bytes()
    pages = list(render_pages(tiff, 0, 3, 10**8))
    assert len(pages) == 3 and Image.open(io.BytesIO(pages[2][0])).size == (1240, 600)


def _shape(rendered) -> list:
    return [(r.code, r.message) if isinstance(r, OcrError) else r[1:] for r in rendered]


def test_a_page_that_cannot_be_rendered_fails_alone():
    tiff = tiff_with_broken_page([page_image(f"T{n}") for n in range(1, 6)], broken=3)
    assert document_plan(tiff, 10**8, 1, 3000, 10**9)[0].frames == 5  # its header is intact
    pages = list(render_pages(tiff, 1, 4, 10**8))
    assert _shape(pages) == [(400, 400), (ErrorCode.CORRUPT_IMAGE, "TIFF page 3 could not be decoded: decoder error -2"),
                             (400, 400), (400, 400)]
    assert pages[0] == next(render_pages(tiff_with_broken_page([page_image(f"T{n}") for n in range(1, 6)], 4), 1, 1,
                                         10**8))  # the same page, the same PNG
    pdf = make_pdf([page_image("P1"), page_image("P2", size=(1600, 1200)), page_image("P3")])
    assert _shape(render_pages(pdf, 0, 3, 1_000_000)) == [
        (400, 400), (ErrorCode.IMAGE_TOO_LARGE, "page 2: 1600x1200 = 1920000 pixels exceeds the limit of 1000000"),
        (400, 400)]


def _pdf_of_parts(parts: list[bytes]) -> bytes:
    import pypdfium2 as pdfium

    out = pdfium.PdfDocument.new()
    for part in parts:
        out.import_pages(pdfium.PdfDocument(part))
    buf = io.BytesIO()
    out.save(buf)
    return buf.getvalue()


async def test_a_page_that_kills_the_decoder_fails_alone_in_the_pool():
    from tests.attacks import nested_xobject_pdf

    pool = DecoderPool(DecodeSettings(workers=1, memory_mb=400, page_timeout_s=60, timeout_s=60), Limits())
    await pool.start()
    try:
        plain, bomb = make_pdf([page_image("A")]), nested_xobject_pdf(depth=8)  # pdfium aborts past its cap
        got = await pool.render_pages(_pdf_of_parts([plain, bomb, plain, plain]), 0, 4)
        assert [r[1:] if not isinstance(r, OcrError) else r.code for r in got] == [
            (400, 400), ErrorCode.IMAGE_TOO_COMPLEX, (400, 400), (400, 400)]
        assert got[1].message.startswith("page 2: the decoder process died reading this image (SIGABRT")
        assert got[0] == got[2] and pool.restarts["died"] == 1
        with pytest.raises(OcrError) as e:  # two pages in a row: the document ends with it
            await pool.render_pages(_pdf_of_parts([plain, bomb, bomb, plain]), 0, 4)
        assert e.value.code is ErrorCode.IMAGE_TOO_COMPLEX and pool.restarts["died"] == 3
        assert isinstance(got[1], DecoderStopped) and not isinstance(got[0], OcrError)
        with pytest.raises(OcrError) as e:  # the page before this batch stopped it too (split_pages passes it on)
            await pool.render_pages(_pdf_of_parts([plain, bomb, plain]), 1, 2, after_stop=True)
        assert e.value.code is ErrorCode.IMAGE_TOO_COMPLEX and pool.restarts["died"] == 4
        tiff = tiff_with_broken_page([page_image(f"T{n}") for n in range(1, 6)], broken=5)
        got = await pool.render_pages(tiff, 2, 4)  # the worker answers the page's own error
        assert _shape(got) == [(400, 400), (400, 400),
                               (ErrorCode.CORRUPT_IMAGE, "TIFF page 5 could not be decoded: decoder error -2")]
        assert _shape(got) == _shape(render_pages(tiff, 2, 4, 10**8)) and got[0] == next(render_pages(tiff, 2, 1, 10**8))
    finally:
        await pool.close()


def _final(n: int, status: str = "ok") -> ResultDocument:
    if status == "error":
        return ResultDocument(request_id=f"d:p{n}", status="error", completed_at_ms=1000 + n,
                              error=ErrorInfo(code=ErrorCode.IMAGE_TOO_LARGE, message="big"))
    return ResultDocument(request_id=f"d:p{n}", status="ok", width=30, height=10, completed_at_ms=1000 + n,
                          lines=[Line(text=f"L{n}", box=BOX, confidence=0.9)], text=f"L{n}")


def test_assembly_in_page_order_with_a_failed_page():
    doc = RequestEvent(request_id="d", content_sha256="a" * 64, filename="x.pdf", submitted_at_ms=900)
    finals = [_final(1), _final(2, "error"), _final(3)]
    pages = [_page_of(n, f, f.lines) for n, f in enumerate(finals, start=1)]
    result = assemble(doc, 3, pages, finals, 0.0)
    assert (result.status, result.failed_pages, result.pages_ok, result.text) == ("partial", [2], 2, "L1\n\nL3")
    assert result.completed_at_ms == 1003 and [p.lines[0].page for p in (pages[0], pages[2])] == [1, 3]
    s = summary(doc, result, finals, "s3://b/documents/d.json", None)
    assert (s.status, s.failed_pages, s.page_count, s.document_id, s.page_number) == ("partial", [2], 3, "d", None)
    assert [ln.page for ln in s.lines] == [1, 3] and s.timings_ms["total"] == 103.0
    assert assemble(doc, 3, pages, finals, 0.0) == result  # the same pages, the same document
    bad = assemble(doc, 3, pages, finals, 0.2)
    assert bad.status == "error" and bad.error.code is ErrorCode.DOCUMENT_PAGES_FAILED
    assert bad.error.message == "1 of 3 pages failed: 2 (image_too_large)"


def test_an_image_that_is_no_document_gets_the_usual_checks():
    from tests.conftest import text_image

    png = text_image(["ONE"])
    info, sizes = document_plan(io.BytesIO(png), 10**8, 20, 3000, 10**9)  # a file, as the decoder passes it
    assert (info.format, info.frames, len(sizes)) == ("PNG", 1, 1)
    gif = (CASES / "img15_animated.gif").read_bytes()
    with pytest.raises(OcrError) as e:
        document_plan(gif, 10**8, 1, 3000, 10**9)
    assert e.value.code is ErrorCode.TOO_MANY_PAGES


def test_progress_line():
    from services.common.documents.state import Progress

    assert Progress("doc-7", 40, 12, 1, None, None).line() == (
        "doc-7: 12/40 pages final (1 failed); assembled when all are final")
    assert Progress("doc-7", 40, 40, 1, "partial", "s3://b/documents/doc-7.json").line() == (
        "doc-7: 40/40 pages final (1 failed); partial, s3://b/documents/doc-7.json")
