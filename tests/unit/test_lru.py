"""The dedup stage's bounded LRU."""

from services.common.cache import CacheEntry
from services.dedup.lru import EntryLru


def entry(i: int) -> CacheEntry:
    return CacheEntry(f"s3://b/results/{i}", i, i, 0)


def test_bounded_by_entries_and_recency():
    lru = EntryLru(max_entries=2, max_bytes=10**6)
    lru.put("a", entry(1))
    lru.put("b", entry(2))
    assert lru.get("a") == entry(1)  # a is now most recent
    lru.put("c", entry(3))
    assert lru.get("b") is None and lru.get("a") == entry(1) and lru.get("c") == entry(3)
    assert len(lru) == 2


def test_bounded_by_bytes():
    size = len("k0") + len(entry(0).to_json())
    lru = EntryLru(max_entries=100, max_bytes=size * 3)
    for i in range(10):
        lru.put(f"k{i}", entry(0))
    assert len(lru) == 3 and lru.bytes <= size * 3
    assert lru.get("k9") is not None and lru.get("k0") is None


def test_entry_too_big_is_not_kept():
    lru = EntryLru(max_entries=10, max_bytes=5)
    lru.put("k", entry(1))
    assert len(lru) == 0 and lru.bytes == 0


def test_entries_expire_after_ttl():
    lru = EntryLru(max_entries=10, max_bytes=10**6, ttl_s=0.0)
    lru.put("k", entry(1))
    assert lru.get("k") is None and len(lru) == 0 and lru.bytes == 0
