"""Reading ``ocr.completed`` from its end without a consumer group (every reader sees every completion)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiokafka import TopicPartition

from schemas.events import CompletedEvent
from services.common.codec import loads
from services.common.kafka import make_consumer, topic_partitions
from services.common.settings import CommonSettings


class CompletionWatcher:
    """Reads ``ocr.completed`` from the current end of every partition (no consumer group).

    Start it *before* submitting so no completion is missed.

    Args:
        settings: Kafka connection and topic names.
        client_id: The Kafka client id the broker sees (its logs and quotas): ``ocrstream-cli``
            for the command, ``ocrstream-api`` for the HTTP door.
    """

    def __init__(self, settings: CommonSettings, client_id: str = "ocrstream-cli"):
        self.s = settings
        self.client_id = client_id
        self.consumer = make_consumer(settings.kafka, [], None, client_id=client_id, auto_offset_reset="latest")

    async def start(self) -> None:
        """Connect, assign all partitions of ``ocr.completed`` and seek to their end."""
        await self.consumer.start()
        parts = self.consumer.partitions_for_topic(self.s.topics.completed)
        if not parts:  # not in the consumer's metadata yet: ask the brokers
            parts = await topic_partitions(self.s.kafka, self.s.topics.completed, self.client_id)
        tps = [TopicPartition(self.s.topics.completed, p) for p in sorted(parts)]
        self.consumer.assign(tps)
        await self.consumer.seek_to_end(*tps)
        for tp in tps:  # resolve positions now, before anything is submitted
            await self.consumer.position(tp)

    async def completions(self, request_ids: set[str]) -> AsyncIterator[CompletedEvent]:
        """Yield the completion of each id in ``request_ids`` once (duplicates skipped)."""
        remaining = set(request_ids)
        while remaining:
            batch = await self.consumer.getmany(timeout_ms=500)
            for recs in batch.values():
                for rec in recs:
                    ev = loads(CompletedEvent, rec.value)
                    if ev.request_id in remaining:
                        remaining.discard(ev.request_id)
                        yield ev

    async def completions_forever(self) -> AsyncIterator[CompletedEvent]:
        """Yield every completion from the start position on (duplicates included)."""
        while True:
            batch = await self.consumer.getmany(timeout_ms=500)
            for recs in batch.values():
                for rec in recs:
                    yield loads(CompletedEvent, rec.value)

    async def stop(self) -> None:
        """Disconnect."""
        await self.consumer.stop()
