"""Reading ``ocr.completed`` from its end without a consumer group (every reader sees every completion)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiokafka import TopicPartition

from schemas.events import CompletedEvent
from services.common.events import loads
from services.common.kafka import make_consumer
from services.common.settings import CommonSettings


class CompletionWatcher:
    """Reads ``ocr.completed`` from the current end of every partition (no consumer group).

    Start it *before* submitting so no completion is missed.
    """

    def __init__(self, settings: CommonSettings):
        self.s = settings
        self.consumer = make_consumer(settings.kafka, [], None, client_id="ocrstream-cli", auto_offset_reset="latest")

    async def start(self) -> None:
        """Connect, assign all partitions of ``ocr.completed`` and seek to their end."""
        await self.consumer.start()
        parts = self.consumer.partitions_for_topic(self.s.topics.completed)
        if not parts:
            await self.consumer._client.force_metadata_update()
            parts = self.consumer.partitions_for_topic(self.s.topics.completed) or set()
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
