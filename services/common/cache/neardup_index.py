"""The near-duplicate index in Redis: perceptual hashes by LSH band, per cache generation.

Keys (prefix ``ocr`` by default):

* ``ocr:nd:<gen_id>:<band>:<value>`` (``ocr:nd:<gen_id>:<scope>:<band>:<value>`` for a tenant's
  cache scope, ``OCRSTREAM_CACHE_SCOPE=key``) a sorted set per band value (8 bands of 8 bits of the
  64-bit pHash); members ``<hash as 16 hex digits>:<sha256>``, scored by the time added (ms).
  Each set keeps only its ``bucket_size`` newest members and expires ``ttl_s`` after its last
  write, so the index stays bounded however many images pass.

Keys include the generation, so images computed by an older engine or model are never
candidates after an upgrade. A member only says "this image was sent to inference": the
caller must check that its cache entry exists before using it (failed or expired results
simply drop out).
"""

from __future__ import annotations

import time

from services.common.cache.entries import ResultCache
from services.common.cache.neardup import HASH_BITS, bands, hamming

N_BANDS = 8


class NearDupIndex:
    """Add and look up perceptual hashes (LSH over :data:`N_BANDS` bands) in Redis.

    Args:
        cache: The Redis client and time budget to use (every call may raise ``CacheUnavailable``).
        bucket_size: Newest members kept per band value.
        ttl_s: A band set expires this long after its last write, s.
    """

    def __init__(self, cache: ResultCache, bucket_size: int = 64, ttl_s: int = 86_400):
        self.cache = cache
        self.bucket_size = bucket_size
        self.ttl_ms = ttl_s * 1000

    def _keys(self, gen_id: str, h: int) -> list[str]:
        width = HASH_BITS // N_BANDS // 4
        return [f"{self.cache.p}:nd:{gen_id}:{i}:{v:0{width}x}" for i, v in enumerate(bands(h, N_BANDS))]

    async def add(self, gen_id: str, content_sha256: str, h: int) -> None:
        """Index image ``content_sha256`` with pHash ``h`` under generation ``gen_id``.

        Raises:
            CacheUnavailable: Redis down or slow.
        """
        now = int(time.time() * 1000)
        member = f"{h:016x}:{content_sha256}"
        pipe = self.cache.client.pipeline(transaction=False)
        for key in self._keys(gen_id, h):
            pipe.zadd(key, {member: now})
            pipe.zremrangebyscore(key, "-inf", now - self.ttl_ms)
            pipe.zremrangebyrank(key, 0, -self.bucket_size - 1)
            pipe.pexpire(key, self.ttl_ms)
        await self.cache.call("nd_add", pipe.execute())

    async def candidates(self, gen_id: str, h: int, max_hamming: int, exclude: str | None = None) -> list[tuple[int, str]]:
        """Indexed images whose pHash is within ``max_hamming`` bits of ``h``, closest first.

        Every image within ``N_BANDS - 1`` bits shares a band with ``h`` and is found (unless
        evicted from a full bucket); farther ones are found only if they share a band.

        Returns:
            ``(distance, content_sha256)`` pairs sorted by distance, then newest first;
            ``exclude`` (the image itself) left out.

        Raises:
            CacheUnavailable: Redis down or slow.
        """
        pipe = self.cache.client.pipeline(transaction=False)
        for key in self._keys(gen_id, h):
            pipe.zrevrange(key, 0, self.bucket_size - 1)
        found: dict[str, int] = {}
        order: dict[str, int] = {}
        for members in await self.cache.call("nd_lookup", pipe.execute()):
            for m in members:
                hx, _, sha = (m.decode() if isinstance(m, bytes) else m).partition(":")
                if sha == exclude or sha in found:
                    continue
                d = hamming(h, int(hx, 16))
                if d <= max_hamming:
                    found[sha] = d
                    order[sha] = len(order)
        return sorted(((d, sha) for sha, d in found.items()), key=lambda x: (x[0], order[x[1]]))
