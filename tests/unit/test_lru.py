"""The dedup stage's bounded LRU."""

from services.common.cache.entries import CacheEntry
from services.common.cache.lru import EntryLru


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


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_entry_never_outlives_its_redis_entry(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("services.common.cache.lru.time.monotonic", clock)
    lru = EntryLru(max_entries=10, max_bytes=10**6, ttl_s=60.0)
    lru.put("short", entry(1), redis_ttl_s=5.0)  # e.g. a screenshot's entry with 5 s left in Redis
    lru.put("long", entry(2), redis_ttl_s=86_000.0)  # a document's: the LRU's own 60 s bound applies
    lru.put("no-expiry", entry(3), redis_ttl_s=None)
    clock.now += 4.9
    assert lru.get("short") == entry(1)
    clock.now += 0.1  # 5 s: gone from Redis, so gone here
    assert lru.get("short") is None and lru.get("long") == entry(2) and lru.get("no-expiry") == entry(3)
    clock.now += 55.0  # 60 s
    assert lru.get("long") is None and lru.get("no-expiry") is None
    assert len(lru) == 0 and lru.bytes == 0


def test_an_entry_already_expired_in_redis_is_not_kept():
    lru = EntryLru(max_entries=10, max_bytes=10**6, ttl_s=60.0)
    lru.put("k", entry(1), redis_ttl_s=0.0)
    assert lru.get("k") is None and len(lru) == 0 and lru.bytes == 0


def test_a_refresh_takes_the_new_ttl(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("services.common.cache.lru.time.monotonic", clock)
    lru = EntryLru(max_entries=10, max_bytes=10**6, ttl_s=60.0)
    lru.put("k", entry(1), redis_ttl_s=10.0)
    clock.now += 9.0
    lru.put("k", entry(1), redis_ttl_s=2.0)  # seen again in Redis with 2 s left
    clock.now += 2.0
    assert lru.get("k") is None
