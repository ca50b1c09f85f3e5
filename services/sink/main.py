"""Wires the sink stage: settings, S3, MariaDB, Redis, handler and the runner."""

from __future__ import annotations

from services.common.app import StageContext, run_stage
from services.common.cache.entries import ResultCache
from services.common.db import Database
from services.common.s3 import ObjectStore
from services.common.settings import load_settings
from services.sink.handler import SinkHandler
from services.sink.settings import SinkSettings


async def main(settings: SinkSettings | None = None) -> None:
    """Run sink until SIGTERM: consume ``ocr.results``; produce ``ocr.completed``."""
    s = settings or load_settings(SinkSettings)

    async def build(ctx: StageContext) -> SinkHandler:
        store, db = ObjectStore(s.s3, ctx.telemetry), Database(s.mysql, telemetry=ctx.telemetry)
        cache = ResultCache(s.redis, ctx.telemetry, "sink")
        for name, check in (("s3", store.ping), ("mysql", db.ping)):
            ctx.telemetry.add_probe(name, check)
        ctx.telemetry.add_probe("redis", cache.ping, required=False)  # a cache: the sink is ready without it
        return SinkHandler(s, store, db, cache, ctx.telemetry)

    await run_stage(
        stage="sink", settings=s, topic=s.topics.results, group_id=s.sink_group_id,
        build_handler=build, max_batch=s.sink_max_batch, max_wait_ms=s.sink_max_wait_ms,
    )
