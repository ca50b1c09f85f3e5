"""Wires the jobs stage: settings, MariaDB, S3, handler and the runner."""

from __future__ import annotations

from services.common.app import StageContext, run_stage
from services.common.db import Database
from services.common.s3 import ObjectStore
from services.common.settings import load_settings
from services.jobs.handler import JobsHandler
from services.jobs.settings import JobsSettings


async def main(settings: JobsSettings | None = None) -> None:
    """Run the jobs stage until SIGTERM: consume ``ocr.jobs`` and ``ocr.completed``; produce
    ``ocr.job-completed``."""
    s = settings or load_settings(JobsSettings)

    async def build(ctx: StageContext) -> JobsHandler:
        store, db = ObjectStore(s.s3, ctx.telemetry), Database(s.mysql, telemetry=ctx.telemetry)
        for name, check in (("s3", store.ping), ("mysql", db.ping)):
            ctx.telemetry.add_probe(name, check)
        return JobsHandler(s, store, db)

    await run_stage(
        stage="jobs", settings=s, topic=[s.topics.jobs, s.topics.completed], group_id=s.jobs_group_id,
        build_handler=build, max_batch=s.jobs_max_batch, max_wait_ms=s.jobs_max_wait_ms,
    )
