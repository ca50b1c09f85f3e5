"""Wires the webhooks stage: settings, MariaDB, the intake handler on the runner, the sender beside it."""

from __future__ import annotations

from services.common.app import StageContext, run_stage
from services.common.db import Database
from services.common.settings import load_settings
from services.webhooks.delivery import WebhookSender
from services.webhooks.handler import WebhooksHandler
from services.webhooks.settings import WebhooksSettings


async def main(settings: WebhooksSettings | None = None) -> None:
    """Run the webhooks stage until SIGTERM: consume ``ocr.completed`` and ``ocr.job-completed``
    into delivery rows, and deliver the due rows (:mod:`services.webhooks.delivery`); produce
    nothing but DLQ events."""
    s = settings or load_settings(WebhooksSettings)

    async def build(ctx: StageContext) -> WebhooksHandler:
        # a connection per attempt in flight, and two for the intake and the delivery loop's claims
        db = Database(s.mysql, pool_size=s.webhook_concurrency + 2, telemetry=ctx.telemetry)
        ctx.telemetry.add_probe("mysql", db.ping)
        sender = WebhookSender(s, db, ctx.telemetry)
        await sender.start()
        return WebhooksHandler(s, db, sender)

    await run_stage(
        stage="webhooks", settings=s, topic=[s.topics.completed, s.topics.job_completed], group_id=s.webhook_group_id,
        build_handler=build, max_batch=s.webhook_max_batch, max_wait_ms=s.webhook_max_wait_ms,
    )
