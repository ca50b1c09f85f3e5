"""The in-process LRU of result documents: bounded by entries and by JSON bytes."""

from schemas.events import OcrOutput
from services.common.cache.outputs import OutputLru


def _doc(i: int) -> OcrOutput:
    return OcrOutput(cache_key=f"{i:012x}:" + "b" * 64, content_sha256="b" * 64, engine="rapidocr", model="m",
                     model_revision="r", task="ocr", pages=[], lines=[], text=f"doc {i}")


def test_bounded_by_entries_and_by_bytes_least_recent_out_first():
    lru = OutputLru(store=None, entries=3, max_bytes=1000)
    for i in range(4):
        lru.remember(f"s3://b/{i}", _doc(i), 100)
    assert len(lru) == 3 and lru.bytes == 300 and "s3://b/0" not in lru._docs
    lru.remember("s3://b/big", _doc(9), 900)  # 1,200 bytes > 1,000: the two oldest go
    assert list(lru._docs) == ["s3://b/3", "s3://b/big"] and lru.bytes == 1000
    lru.remember("s3://b/3", _doc(3), 100)  # the same URI again is not counted twice
    assert lru.bytes == 1000 and len(lru) == 2
    lru.remember("s3://b/huge", _doc(10), 1001)  # larger than the whole bound: not kept
    assert "s3://b/huge" not in lru._docs and lru.bytes == 1000


def test_zero_entries_keeps_nothing():
    lru = OutputLru(store=None, entries=0)
    lru.remember("s3://b/0", _doc(0), 10)
    assert len(lru) == 0 and lru.bytes == 0
