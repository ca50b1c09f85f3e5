"""Single flight past the waiter bound, on the real stack: 5,000 copies of one new image, and a PDF
of 2,000 identical pages, each cost exactly one engine call; the copies past ``max_waiters`` (1,000
held in memory) wait in dedup's changelog and are answered when the key settles
(docs/single-flight.md). Before: every copy past the bound was computed again (2,000 copies gave
1,000 engine calls), and an unrelated image on the same partition waited behind them for minutes.

Its own pipeline (CPU engine, detector at 96 px: one-line images, as the job tests'); the unrelated
image's time during the flood is held to its time alone plus a wide margin (a liveness bound for a
loaded CI machine, not a speed check: it was 684 s before)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import text_image
from tests.documents import make_pdf, page_image
from tests.stack import namespaced_pipeline

pytestmark = pytest.mark.stack

COPIES = 5000
PAGES = 2000


@pytest.fixture(scope="module")
def flood(tmp_path_factory):
    extra = {"OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN": "96", "OCRSTREAM_LIMITS__MAX_DOCUMENT_PAGES": str(PAGES)}
    with namespaced_pipeline(tmp_path_factory.mktemp("flood-logs"), extra, partitions=2) as p:
        yield p


async def _timed(p, items) -> tuple[list, float]:
    started = time.monotonic()
    docs = await p.run(items, timeout=900)
    return docs, time.monotonic() - started


async def test_5000_copies_of_one_image_are_one_engine_call_and_hold_back_no_other_image(flood):
    p = flood
    [alone], alone_s = await _timed(p, [(text_image(["ALONE 7310"], size=28), "alone.png")])
    assert alone.status == "ok"
    calls = p.engine_calls()
    image = text_image(["FLOOD 7311"], size=28)
    copies = asyncio.create_task(p.run([(image, f"copy{i}.png") for i in range(COPIES)], timeout=1200))
    await asyncio.sleep(2)  # the flood is in ingest and dedup
    [other], other_s = await _timed(p, [(text_image(["OTHER 7312"], size=28), "other.png")])
    docs = await copies
    assert other.status == "ok" and other.text.replace(" ", "") == "OTHER7312", (other.status, other.text)
    assert len(docs) == COPIES and {d.status for d in docs} == {"ok"}
    assert len({d.text for d in docs}) == 1  # every copy the one result
    assert p.engine_calls() - calls == 2  # the flood's image once, the other image once
    print(f"the other image took {other_s:.1f} s during the flood, {alone_s:.1f} s alone")
    assert other_s < alone_s + 180, (other_s, alone_s)  # behind the flood it took 684 s


async def test_a_pdf_of_2000_identical_pages_is_one_engine_call(flood):
    p = flood
    page = page_image("SAME PAGE 7313", size=(300, 120))
    pdf = make_pdf([page] * PAGES)
    calls = p.engine_calls()
    [doc] = await p.run([(pdf, "same.pdf")], timeout=1200)
    assert doc.status == "ok" and doc.page_count == PAGES, (doc.status, doc.error, doc.page_count)
    assert p.engine_calls() - calls == 1
    texts = doc.text.split("\n\n")
    assert len(texts) == PAGES and len(set(texts)) == 1
