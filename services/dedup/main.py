"""Wires the dedup stage: settings, Redis cache, handler and the runner."""

from __future__ import annotations

from services.common.app import StageContext, run_stage
from services.common.cache import ResultCache
from services.dedup.handler import DedupHandler
from services.dedup.settings import DedupSettings


async def main(settings: DedupSettings | None = None) -> None:
    """Run dedup until SIGTERM: consume ``ocr.requests``; produce ``ocr.infer`` and ``ocr.results``."""
    s = settings or DedupSettings()

    async def build(ctx: StageContext) -> DedupHandler:
        cache = ResultCache(s.redis, ctx.telemetry, "dedup")
        ctx.telemetry.add_probe("redis", cache.ping)
        return DedupHandler(s, cache, ctx.telemetry)

    await run_stage(
        stage="dedup", settings=s, topic=s.topics.requests, group_id=s.dedup_group_id,
        build_handler=build, max_batch=s.dedup_max_batch, max_wait_ms=s.dedup_max_wait_ms,
    )
