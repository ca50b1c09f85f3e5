"""Wires the dedup stage: settings, Redis cache, handler and the runner."""

from __future__ import annotations

from services.common.app import StageContext, run_stage
from services.common.cache import ResultCache
from services.common.decoding import DecoderPool
from services.common.s3 import ObjectStore
from services.common.settings import load_settings
from services.dedup.backlog import DownstreamBacklog
from services.dedup.handler import DedupHandler
from services.dedup.near import NearDupLookup
from services.dedup.settings import DedupSettings


async def main(settings: DedupSettings | None = None) -> None:
    """Run dedup until SIGTERM: consume ``ocr.requests``; produce ``ocr.infer`` and ``ocr.results``.

    With ``OCRSTREAM_NEAR_DUP__ENABLED`` it also reads S3 (images and result documents)."""
    s = settings or load_settings(DedupSettings)

    async def build(ctx: StageContext) -> DedupHandler:
        cache = ResultCache(s.redis, ctx.telemetry, "dedup")
        ctx.telemetry.add_probe("redis", cache.ping)
        near = None
        if s.near_dup.enabled and s.cache_enabled:
            store = ObjectStore(s.s3, ctx.telemetry)
            ctx.telemetry.add_probe("s3", store.ping)
            near = NearDupLookup(s.near_dup, DecoderPool(s.decode, s.limits), store, cache)
        backlog = DownstreamBacklog(s.kafka, [(s.topics.infer, s.infer_group_id), (s.topics.results, s.sink_group_id)])
        return DedupHandler(s, cache, ctx.telemetry, near, backlog)

    await run_stage(
        stage="dedup", settings=s, topic=s.topics.requests, group_id=s.dedup_group_id,
        build_handler=build, max_batch=s.dedup_max_batch, max_wait_ms=s.dedup_max_wait_ms,
    )
