"""Wires the ingest stage: settings, S3 and MariaDB clients, handler and the runner."""

from __future__ import annotations

from services.common.app import StageContext, run_stage
from services.common.db import Database
from services.common.images.decoding import DecoderPool
from services.common.s3 import ObjectStore
from services.common.settings import load_settings
from services.ingest.handler import IngestHandler
from services.ingest.settings import IngestSettings


async def main(settings: IngestSettings | None = None) -> None:
    """Run ingest until SIGTERM: consume ``ocr.submit``, produce ``ocr.requests``."""
    s = settings or load_settings(IngestSettings)

    async def build(ctx: StageContext) -> IngestHandler:
        store = ObjectStore(s.s3, ctx.telemetry)
        db = Database(s.mysql, pool_size=s.ingest_concurrency, telemetry=ctx.telemetry)  # request id claims
        ctx.telemetry.add_probe("s3", store.ping)
        ctx.telemetry.add_probe("mysql", db.ping)
        decoder = DecoderPool(s.decode, s.limits)
        await decoder.start()
        return IngestHandler(s, store, ctx.telemetry, decoder, db=db)

    await run_stage(
        stage="ingest", settings=s, topic=s.topics.submit, group_id=s.ingest_group_id,
        build_handler=build, max_batch=s.ingest_max_batch, max_wait_ms=s.ingest_max_wait_ms,
    )
