"""The cache: a computed result answered again without the engine.

- :mod:`.entries`: the Redis tier (a pointer per cache key to the stored result; losable).
- :mod:`.lru`: dedup's in-process LRU of entries, in front of Redis.
- :mod:`.outputs`: stored output documents read from S3, kept in a bounded in-process LRU.
- :mod:`.neardup` and :mod:`.neardup_index`: near-duplicate images (perceptual hash, LSH bands in Redis).
- :mod:`.field_index`: which field sets of an image are stored in S3, so a subset is answered from them.
- :mod:`.keys`: the cache key and what it is made of (engine identity, tasks, scope:
  :class:`~.keys.CacheKeySettings`), and :mod:`.prompts`, the VLM prompts, which are part of it.

Dedup's near-duplicate lookup (``services/dedup/near.py``) reads dedup's settings and stays in dedup.
"""
