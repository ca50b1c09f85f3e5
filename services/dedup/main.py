"""Wires the dedup stage: settings, the cache tiers, the keyed state and its changelog, the runner."""

from __future__ import annotations

from services.common.app import StageContext, run_stage
from services.common.cache.entries import ResultCache
from services.common.images.decoding import DecoderPool
from services.common.kafka import check_copartitioned
from services.common.s3 import ObjectStore
from services.common.settings import load_settings
from services.dedup.changelog import Changelog
from services.dedup.handler import DedupHandler
from services.dedup.near import NearDupLookup
from services.dedup.settings import DedupSettings


async def main(settings: DedupSettings | None = None) -> None:
    """Run dedup until SIGTERM: consume ``ocr.requests`` (requests and settlements, one log per
    key); produce ``ocr.infer-interactive``, ``ocr.infer``, ``ocr.results`` and the changelog
    (partition p of the changelog holds the state of ``ocr.requests`` partition p).

    Raises:
        SystemExit: ``ocr.requests`` and the changelog have different partition counts (run
            ``ocrstream init``).
    """
    s = settings or load_settings(DedupSettings)

    async def build(ctx: StageContext) -> DedupHandler:
        await check_copartitioned(s.kafka, s.topics.copartitioned())
        cache = ResultCache(s.redis, ctx.telemetry, "dedup")
        ctx.telemetry.add_probe("redis", cache.ping, required=False)  # a cache: dedup is ready without it
        store = ObjectStore(s.s3, ctx.telemetry)
        ctx.telemetry.add_probe("s3", store.ping)
        changelog = Changelog(s.kafka, s.topics.dedup_changelog, ctx.producer, s.restore_timeout_s)
        handler = DedupHandler(s, cache, ctx.telemetry, store, changelog)
        if s.near_dup.enabled and s.cache_enabled:
            handler.near = NearDupLookup(s.near_dup, DecoderPool(s.decode, s.limits), store, cache,
                                         resolve=handler.resolve)
        return handler

    await run_stage(
        stage="dedup", settings=s, topic=s.topics.requests, group_id=s.dedup_group_id,
        build_handler=build, max_batch=s.dedup_max_batch, max_wait_ms=s.dedup_max_wait_ms,
        drain_on_revoke=True,
    )
