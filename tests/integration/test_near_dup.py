"""Near-duplicate lookup on the real pipeline (opt-in): a re-encoded, rescaled copy is answered
from the original's result with boxes in its own pixels; a same-template document with another
number is read by the engine."""

from __future__ import annotations

import asyncio
import hashlib
import io
import time

import pytest
from PIL import Image

from services.common.cache.entries import ResultCache
from services.common.cache.neardup_index import NearDupIndex
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.stack import metric_value, namespaced_pipeline

LINES = ["INVOICE NO 40213", "DATE 2024-03-18", "TOTAL 237.60"]


def variant(data: bytes, scale: float, quality: int) -> bytes:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    img = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


@pytest.fixture(scope="module")
def nd_pipeline(stack_env, tmp_path_factory):
    """A pipeline of its own with near-duplicate lookup on."""
    with namespaced_pipeline(tmp_path_factory.mktemp("nd-logs"), {"OCRSTREAM_NEAR_DUP__ENABLED": "true"}) as p:
        yield p


async def test_reencoded_copy_is_a_near_hit_and_a_template_sibling_is_not(nd_pipeline):
    original = text_image(LINES, size=40, width=900)
    calls = nd_pipeline.engine_calls()
    [first] = await nd_pipeline.run([(original, "invoice.png")])
    assert first.status == "ok" and not first.cache_hit and first.near_duplicate_of is None
    assert "40213" in first.text
    assert nd_pipeline.engine_calls() == calls + 1

    copy = variant(original, 1.2, 70)
    [near] = await nd_pipeline.run([(copy, "invoice-copy.jpg")])
    assert near.status == "ok" and near.cache_hit, near
    assert near.near_duplicate_of == first.content_sha256
    assert near.content_sha256 == hashlib.sha256(copy).hexdigest()
    assert near.text == first.text
    w, h = Image.open(io.BytesIO(copy)).size
    assert (near.width, near.height) == (w, h) and near.pages[0].width == w
    sx, sy = w / first.width, h / first.height
    for a, b in zip(first.lines, near.lines, strict=True):
        assert a.text == b.text
        for (xa, ya), (xb, yb) in zip(a.box, b.box):
            assert abs(xa * sx - xb) < 0.02 and abs(ya * sy - yb) < 0.02
    assert nd_pipeline.engine_calls() == calls + 1

    sibling = text_image([t.replace("40213", "40218") for t in LINES], size=40, width=900)
    [other] = await nd_pipeline.run([(sibling, "invoice-2.png")])
    assert other.status == "ok" and not other.cache_hit and other.near_duplicate_of is None
    assert "40218" in other.text and "40213" not in other.text
    assert nd_pipeline.engine_calls() == calls + 2

    # the near hit was stored under the copy's own key: a byte-identical repeat is an exact hit
    [again] = await nd_pipeline.run([(copy, "invoice-copy.jpg")])
    assert again.cache_hit and again.near_duplicate_of == first.content_sha256 and again.text == first.text
    assert nd_pipeline.engine_calls() == calls + 2


async def test_copies_arriving_together_all_complete_from_one_near_hit(nd_pipeline):
    original = text_image(["ORDER 5521", "AMOUNT 12.90"], size=40, width=800)
    [first] = await nd_pipeline.run([(original, "order.png")])
    calls = nd_pipeline.engine_calls()
    copy = variant(original, 0.9, 80)
    docs = await nd_pipeline.run([(copy, f"order-copy-{i}.jpg") for i in range(4)], timeout=120)
    assert all(d.status == "ok" and d.cache_hit and d.text == first.text for d in docs)
    assert {d.near_duplicate_of for d in docs} == {first.content_sha256}
    assert nd_pipeline.engine_calls() == calls
    # the copies' key left dedup's state: nothing in flight, no copy waiting
    def state(kind: str) -> float | None:
        text = nd_pipeline.metrics("dedup")
        return metric_value(text, "ocrstream_dedup_state", kind=kind) if f'ocrstream_dedup_state{{kind="{kind}"}}' in text else None

    deadline = time.monotonic() + 30  # the gauge is set after each batch
    while (state("in_flight"), state("waiters")) != (0, 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert (state("in_flight"), state("waiters")) == (0, 0)


async def test_index_is_bounded_and_per_generation(nd_pipeline):
    s = CommonSettings()
    cache = ResultCache(s.redis)
    index = NearDupIndex(cache, bucket_size=3, ttl_s=60)
    try:
        h = 0x0123456789ABCDEF
        for i in range(5):
            await index.add("gen-a", f"{i:064d}", h ^ (1 << i))
            await asyncio.sleep(0.003)  # scores are ms: two adds in one ms would tie (then ordered by member)
        found = await index.candidates("gen-a", h, max_hamming=2)
        assert [sha for _, sha in found] == [f"{i:064d}" for i in (4, 3, 2)]  # the 3 newest, all 1 bit away
        assert await index.candidates("gen-b", h, max_hamming=64) == []
        assert await index.candidates("gen-a", h, max_hamming=2, exclude=f"{4:064d}") != found
        assert 0 < await cache.client.pttl(index._keys("gen-a", h)[0]) <= 60_000
    finally:
        await cache.close()
