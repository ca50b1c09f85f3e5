"""Near-duplicate lookup for dedup: on an exact miss, find a verified look-alike already done."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from schemas.events import OcrOutput
from schemas.keys import CacheGeneration, cache_key, image_object_key
from schemas.reading import Line
from services.common.cache.entries import CacheUnavailable, ResultCache
from services.common.images.decoding import DecoderPool
from services.common.cache.neardup import Verdict, phash64, scale_lines, verify
from services.common.cache.neardup_index import NearDupIndex
from services.common.s3 import ObjectStore
from services.dedup.settings import NearDupSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NearHit:
    """A verified near duplicate: the new image's result, built from the candidate's.

    Attributes:
        of_sha256: SHA-256 of the image whose result is reused.
        distance: pHash Hamming distance between the two images (bits).
        verdict: The window-by-window verification that accepted the pair.
        width, height: Size of the new image (upright), in pixels.
        lines: The candidate's lines with boxes scaled to the new image's size.
        output: The candidate's stored result document.
    """

    of_sha256: str
    distance: int
    verdict: Verdict
    width: int
    height: int
    lines: list[Line]
    output: OcrOutput


class NearDupLookup:
    """Looks up and indexes images by perceptual hash; verifies every candidate before use.

    Only single-page images are looked up. Images read by inference are indexed (under their
    cache generation) once their result is settled; near hits are not, so a chain of
    look-alikes never drifts away from the image that was actually read.

    Args:
        settings: Near-duplicate settings (thresholds, index bounds).
        decoder: Decodes the images (in decoder processes, bounded in time and memory).
        store: Where the images and result documents are (S3).
        cache: The result cache (entries, and the Redis client for the index).
        index: The pHash index; by default a :class:`NearDupIndex` on ``cache``'s Redis.
        resolve: A candidate's result document when Redis has no entry for it (dedup's S3 tier):
            cache key -> ``s3://`` URI or None.
    """

    def __init__(self, settings: NearDupSettings, decoder: DecoderPool, store: ObjectStore, cache: ResultCache,
                 index: NearDupIndex | None = None, resolve: Callable[[str], Awaitable[str | None]] | None = None):
        self.s = settings
        self.decoder = decoder
        self.store = store
        self.cache = cache
        self.index_ = index or NearDupIndex(cache, settings.bucket_size, settings.index_ttl_s)
        self.resolve = resolve
        self.params = settings.verify_params()

    async def _page(self, uri_or_key: str, is_uri: bool) -> np.ndarray | None:
        """The only page of the image, or None for a multi-page one (the array keeps its shared
        buffer alive; nothing is taken from a pixel budget: one image at a time per request)."""
        get = self.store.get_uri if is_uri else self.store.get
        data = await get(uri_or_key, max_bytes=self.s.max_image_bytes)
        decoded = await self.decoder.decode_all(data)
        return decoded.pages[0] if len(decoded.pages) == 1 else None

    async def close(self) -> None:
        """Stop the decoder processes."""
        await self.decoder.close()

    async def find(self, content_sha256: str, image_uri: str, frames: int, gen: CacheGeneration,
                   scope: str | None = None) -> tuple[NearHit | None, int | None, str]:
        """The verified near duplicate of this image under ``gen``, if any, and the image's hash.

        Nothing is indexed here: the caller indexes the image (:meth:`index`) once its own result
        is settled, so a look-alike arriving later finds a candidate whose result exists, and a
        slow Redis at the moment the first copy arrives does not keep it out of the index.

        Args:
            content_sha256: The new image's SHA-256 (an exact miss).
            image_uri: Where the new image is (``s3://``).
            frames: Pages/frames of the new image (only 1 is looked up).
            gen: The cache generation; only results of this generation are candidates.
            scope: The request's cache scope (:meth:`CacheKeySettings.cache_scope_of`); None =
                global. Candidates are indexed, and their entries looked up, in this scope only:
                a tenant's look-alike is never answered from another tenant's result.

        Returns:
            ``(hit or None, the page's 64-bit pHash or None when not computed, index space)``.

        Raises:
            CacheUnavailable: Redis down or slow (the caller treats it as a miss).
            OcrError: The image could not be fetched or decoded (the caller treats it as a miss;
                inference then reports the error properly).
        """
        space = gen.gen_id if scope is None else f"{gen.gen_id}:{scope}"  # purge's nd:<gen_id>:* covers both
        if frames != 1:
            return None, None, space
        page = await self._page(image_uri, is_uri=True)
        if page is None:
            return None, None, space
        h = await asyncio.to_thread(phash64, page)
        try:
            found = await self.index_.candidates(space, h, self.s.max_hamming, exclude=content_sha256)
        except CacheUnavailable:
            return None, h, space
        for distance, sha in found[: self.s.max_candidates]:
            hit = await self._try(sha, distance, page, gen, scope)
            if hit is not None:
                return hit, h, space
        return None, h, space

    async def index(self, space: str, content_sha256: str, h: int) -> None:
        """Index an image whose result is settled (from :meth:`find`'s hash and space).

        Raises:
            CacheUnavailable: Redis down or slow (the caller may try again).
        """
        await self.index_.add(space, content_sha256, h)

    async def _result_uri(self, key: str) -> str | None:
        """Where ``key``'s result document is: the Redis entry, else ``resolve`` (the S3 tier), else None."""
        try:
            entry = await self.cache.get(key)
        except CacheUnavailable:
            entry = None
        if entry is not None:
            return entry.result_uri
        return await self.resolve(key) if self.resolve is not None else None

    async def _try(self, sha: str, distance: int, page: np.ndarray, gen: CacheGeneration,
                   scope: str | None = None) -> NearHit | None:
        uri = await self._result_uri(cache_key(sha, gen, scope))
        if uri is None:  # not done yet, failed, expired or purged
            return None
        try:
            other = await self._page(image_object_key(sha), is_uri=False)
        except Exception as exc:  # noqa: BLE001 - a candidate we cannot read is no candidate
            log.info("dedup: near-duplicate candidate %s unreadable (%s)", sha, exc)
            return None
        if other is None:
            return None
        verdict = await asyncio.to_thread(verify, other, page, self.params)
        log.info("dedup: near-duplicate candidate %s at %d bits: %s (worst window %.2f)", sha, distance,
                 verdict.reason, verdict.worst_block)
        if not verdict.match:
            return None
        output = await self._output(uri)
        if output is None or len(output.pages) != 1:
            return None
        src = (output.pages[0].width, output.pages[0].height)
        if src != (other.shape[1], other.shape[0]):  # boxes must be in the pixels we compared
            return None
        h, w = page.shape[:2]
        return NearHit(sha, distance, verdict, w, h, scale_lines(output.lines, src, (w, h)), output)

    async def _output(self, uri: str) -> OcrOutput | None:
        try:
            return OcrOutput.model_validate_json(await self.store.get_uri(uri))
        except Exception as exc:  # noqa: BLE001 - a vanished or unreadable document: no hit
            log.info("dedup: near-duplicate result %s unreadable (%s)", uri, exc)
            return None

