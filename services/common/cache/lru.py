"""A bounded in-process LRU (entries and bytes) in front of Redis."""

from __future__ import annotations

import time
from collections import OrderedDict

from services.common.cache.entries import CacheEntry


class EntryLru:
    """LRU of cache entries, bounded by entry count, approximate bytes and age.

    Args:
        max_entries: Most entries kept.
        max_bytes: Most bytes kept (key length + serialised entry length).
        ttl_s: Entries older than this are dropped, so a ``cache purge`` in Redis reaches
            every dedup process within ``ttl_s`` seconds. An entry put with its Redis time to
            live is dropped when that runs out, if sooner: it never outlives its Redis entry.
    """

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float = 60.0):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._data: OrderedDict[str, tuple[CacheEntry, int, float]] = OrderedDict()  # entry, size, deadline
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` (and mark it recently used), or None."""
        item = self._data.get(key)
        if item is None:
            return None
        if time.monotonic() >= item[2]:
            self.bytes -= item[1]
            del self._data[key]
            return None
        self._data.move_to_end(key)
        return item[0]

    def put(self, key: str, entry: CacheEntry, redis_ttl_s: float | None = None) -> None:
        """Insert or refresh ``key``, evicting least recently used entries past the bounds.

        Args:
            key: The cache key.
            entry: Its entry.
            redis_ttl_s: Seconds the entry has left in Redis (``PTTL`` / 1000, :attr:`Claim.ttl_ms`);
                the entry is kept ``min(ttl_s, redis_ttl_s)``. None: no expiry in Redis, ``ttl_s``.
        """
        age_limit = self.ttl_s if redis_ttl_s is None else min(self.ttl_s, redis_ttl_s)
        size = len(key) + len(entry.to_json())
        old = self._data.pop(key, None)
        if old:
            self.bytes -= old[1]
        if size > self.max_bytes or self.max_entries <= 0 or age_limit <= 0:
            return
        self._data[key] = (entry, size, time.monotonic() + age_limit)
        self.bytes += size
        while len(self._data) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, sz, _) = self._data.popitem(last=False)
            self.bytes -= sz

    def drop(self, key: str) -> None:
        """Forget ``key`` (its document is gone)."""
        old = self._data.pop(key, None)
        if old:
            self.bytes -= old[1]

    def clear(self) -> None:
        """Drop every entry."""
        self._data.clear()
        self.bytes = 0
