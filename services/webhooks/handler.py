"""Webhooks intake: each completion with a callback becomes one ``webhook_deliveries`` row.

The stage's runner hands this handler batches of ``ocr.completed`` and ``ocr.job-completed``
records; it writes a delivery row for each one whose request has a ``callback_url`` (or whose job
has a ``webhook_url``) and returns nothing to produce, so the runner commits the batch's offsets
only after the rows are written. The rows are delivered by :class:`~services.webhooks.delivery.WebhookSender`.
"""

from __future__ import annotations

import hashlib
import logging

import orjson

from schemas.events import CompletedEvent, now_ms
from schemas.jobs import JobCompletedEvent
from services.common.codec import loads
from services.common.db import Database
from services.common.dlq import poison_messages
from services.common.handler import Handler, Outgoing, Record
from services.common.webhooks.store import NewDelivery, WebhookStore
from services.webhooks.delivery import WebhookSender
from services.webhooks.settings import WebhooksSettings

log = logging.getLogger(__name__)


def delivery_id(group_id: str, event_id: str) -> str:
    """The deterministic id of the delivery of completion ``event_id`` by webhooks group
    ``group_id``: ``"whd_"`` plus 40 hex digits (SHA-256 of both; a completion read again gets the
    same id, so it is not delivered twice)."""
    return "whd_" + hashlib.sha256(f"{group_id}\n{event_id}".encode()).hexdigest()[:40]


class WebhooksHandler(Handler):
    """Per batch: the deliveries of the completions that name a callback, enqueued in one
    transaction (:meth:`WebhookStore.enqueue`, idempotent by delivery id: a replayed batch adds
    no row). An unreadable completion is logged and skipped: it has no callback to deliver to.

    Args:
        settings: The stage's settings (topics, ``webhook_group_id``, ``webhook_retry_for_s``).
        db: The MariaDB pool.
        sender: The process's :class:`WebhookSender`, told of each batch's new rows (it looks for
            due rows at once) and stopped with the stage (:meth:`close`); None in a unit test.
    """

    def __init__(self, settings: WebhooksSettings, db: Database, sender: WebhookSender | None = None):
        self.s = settings
        self.db = db
        self.store = WebhookStore(db, settings.webhook_group_id)
        self.sender = sender

    async def handle(self, records: list[Record]) -> list[Outgoing]:
        """See :meth:`Handler.handle` and the class docstring. Values arrive as bytes (no model is
        declared): most completions have no callback, and a plain parse decides that first."""
        items = [d for rec in records if (d := self.delivery_of(rec)) is not None]
        if items:
            await self.store.enqueue(items, now_ms(), int(self.s.webhook_retry_for_s * 1000))
            if self.sender is not None:
                self.sender.enqueued(len(items))
        return []

    def delivery_of(self, rec: Record) -> NewDelivery | None:
        """The delivery a completion record asks for, or None (no callback, or unreadable)."""
        if rec.topic == self.s.topics.job_completed:
            return self._job_delivery_of(rec)
        try:
            raw = orjson.loads(rec.raw)
            result = raw.get("result") if isinstance(raw, dict) else None
            if isinstance(result, dict) and not result.get("callback_url"):
                return None
            ev = loads(CompletedEvent, rec.raw)
        except ValueError as exc:
            log.warning("webhooks: unreadable completion %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, exc)
            return None
        url = ev.result.callback_url
        if not url:
            return None
        return NewDelivery(delivery_id(self.s.webhook_group_id, ev.event_id), ev.request_id, ev.result.api_key_id,
                           url, rec.raw.decode())

    def _job_delivery_of(self, rec: Record) -> NewDelivery | None:
        """A job completion (``ocr.job_completed.v1``) with a ``webhook_url``: delivered like a
        request's, signed with the creating key's secret; ``request_id`` holds the job id."""
        try:
            ev = loads(JobCompletedEvent, rec.raw)
        except ValueError as exc:
            log.warning("webhooks: unreadable job completion %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, exc)
            return None
        if not ev.webhook_url:
            return None
        return NewDelivery(delivery_id(self.s.webhook_group_id, ev.event_id), ev.job_id, ev.api_key_id,
                           ev.webhook_url, rec.raw.decode())

    def poison(self, record: Record, exc: BaseException, attempts: int) -> list[Outgoing]:
        """The DLQ event only: a completion whose delivery cannot be stored ends no request. (No
        model is declared, so no value is undecodable: every one, a tombstone too, reaches
        :meth:`handle`, which skips what it cannot read.)"""
        return [m for m in poison_messages(stage="webhooks", topics=self.s.topics, record=record, exc=exc,
                                           attempts=attempts) if m.topic == self.s.topics.dlq]

    async def dependencies_ok(self) -> bool | None:
        """MariaDB answers a ping."""
        try:
            return bool(await self.db.ping())
        except Exception:  # noqa: BLE001 - not answering is the answer
            return False

    async def close(self) -> None:
        """Stop the sender: attempts in flight get a few seconds, the rest come due again at once."""
        if self.sender is not None:
            await self.sender.stop()
