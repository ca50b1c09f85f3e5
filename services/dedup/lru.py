"""A bounded in-process LRU (entries and bytes) in front of Redis."""

from __future__ import annotations

import time
from collections import OrderedDict

from services.common.cache import CacheEntry


class EntryLru:
    """LRU of cache entries, bounded by entry count, approximate bytes and age.

    Args:
        max_entries: Most entries kept.
        max_bytes: Most bytes kept (key length + serialised entry length).
        ttl_s: Entries older than this are dropped, so a ``cache purge`` in Redis reaches
            every dedup process within ``ttl_s`` seconds.
    """

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float = 60.0):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._data: OrderedDict[str, tuple[CacheEntry, int, float]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` (and mark it recently used), or None."""
        item = self._data.get(key)
        if item is None:
            return None
        if time.monotonic() - item[2] > self.ttl_s:
            self.bytes -= item[1]
            del self._data[key]
            return None
        self._data.move_to_end(key)
        return item[0]

    def put(self, key: str, entry: CacheEntry) -> None:
        """Insert or refresh ``key``, evicting least recently used entries past the bounds."""
        size = len(key) + len(entry.to_json())
        old = self._data.pop(key, None)
        if old:
            self.bytes -= old[1]
        if size > self.max_bytes or self.max_entries <= 0:
            return
        self._data[key] = (entry, size, time.monotonic())
        self.bytes += size
        while len(self._data) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, sz, _) = self._data.popitem(last=False)
            self.bytes -= sz

    def clear(self) -> None:
        """Drop every entry."""
        self._data.clear()
        self.bytes = 0
