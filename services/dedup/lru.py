"""A bounded in-process LRU (entries and bytes) in front of Redis."""

from __future__ import annotations

from collections import OrderedDict

from services.common.cache import CacheEntry


class EntryLru:
    """LRU of cache entries, bounded by entry count and by approximate bytes.

    Args:
        max_entries: Most entries kept.
        max_bytes: Most bytes kept (key length + serialised entry length).
    """

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, tuple[CacheEntry, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` (and mark it recently used), or None."""
        item = self._data.get(key)
        if item is None:
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
        self._data[key] = (entry, size)
        self.bytes += size
        while len(self._data) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, sz) = self._data.popitem(last=False)
            self.bytes -= sz

    def clear(self) -> None:
        """Drop every entry."""
        self._data.clear()
        self.bytes = 0
