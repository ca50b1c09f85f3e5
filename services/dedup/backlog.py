"""Is a lease holder still on its way? The backlog of the stages after dedup, read from Kafka.

A lease holder's event is never lost while it travels: dedup commits its ``ocr.requests`` offset
only after ``ocr.infer`` has the holder's event, infer commits only after ``ocr.results`` has the
result, and the sink commits only after it has completed the key. So until the key is
completed, the holder's message sits in ``ocr.infer`` or ``ocr.results`` at or after the
consuming group's committed offset. If the group that reads a topic has committed everything on
the partition the holder's key maps to, the holder is not queued there.

Dedup's reaper asks this before it replaces a holder whose lease deadline has passed: a holder
that is merely queued behind a backlog (or waiting for a stopped infer) keeps its lease, so a
backlog longer than ``OCRSTREAM_LEASE_MS`` never makes copies of one image into several
inferences. A holder is replaced only when neither partition it could be on has anything
uncommitted, i.e. its result was handled but the key was never completed (a sink that lost a
completion it had deferred while Redis was down, or Redis data lost).
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.partitioner import DefaultPartitioner

from services.common.kafka import make_admin, make_consumer
from services.common.settings import KafkaSettings

log = logging.getLogger(__name__)


class BacklogUnknown(Exception):
    """Kafka did not answer the lag query within its time budget (or errored)."""

    retriable = True


class DownstreamBacklog:
    """Which partitions of the watched topics hold messages their consumer group has not committed.

    Args:
        cfg: Kafka connection settings.
        watched: ``(topic, consumer group)`` pairs, e.g. ``[("ocr.infer", "ocrstream-infer"),
            ("ocr.results", "ocrstream-sink")]``.
        timeout_s: Time budget of one :meth:`busy_partitions` call, s.

    Keys map to partitions as the producers' default partitioner does (murmur2 of the key bytes
    modulo the topic's partition count, the Java client's and aiokafka's default), because every
    stage keys its messages by the image's SHA-256 and never picks partitions itself.
    """

    def __init__(self, cfg: KafkaSettings, watched: list[tuple[str, str]], timeout_s: float = 5.0):
        self.cfg = cfg
        self.watched = watched
        self.timeout_s = timeout_s
        self._admin: AIOKafkaAdminClient | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._partitions: dict[str, list[int]] = {}

    async def _start(self) -> None:
        if self._consumer is None:
            admin = make_admin(self.cfg, "ocrstream-dedup-backlog")
            consumer = make_consumer(self.cfg, [], None, "ocrstream-dedup-backlog")  # no group: reads offsets only
            await admin.start()
            try:
                await consumer.start()
            except BaseException:
                await admin.close()
                raise
            self._admin, self._consumer = admin, consumer
        for topic, _ in self.watched:
            if not self._partitions.get(topic):
                await self._consumer.topics()  # refreshes the metadata of every topic
                self._partitions[topic] = sorted(self._consumer.partitions_for_topic(topic) or [])

    async def busy_partitions(self) -> dict[str, set[int]]:
        """For each watched topic, the partitions where the end offset is past the group's
        committed offset (a partition the group never committed counts from its first offset).

        Returns:
            Topic -> partition numbers with uncommitted messages (empty set: none).

        Raises:
            BacklogUnknown: Kafka errored or did not answer within ``timeout_s``; the caller
                must then assume every partition is busy.
        """
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._start()
                busy: dict[str, set[int]] = {}
                for topic, group in self.watched:
                    tps = [TopicPartition(topic, p) for p in self._partitions[topic]]
                    if not tps:
                        raise BacklogUnknown(f"topic {topic} has no partitions in the metadata")
                    committed = await self._admin.list_consumer_group_offsets(group, partitions=tps)
                    ends = await self._consumer.end_offsets(tps)
                    starts = await self._consumer.beginning_offsets(tps)
                    busy[topic] = set()
                    for tp in tps:
                        meta = committed.get(tp)
                        done = meta.offset if meta is not None and meta.offset >= 0 else starts[tp]
                        if ends[tp] > done:
                            busy[topic].add(tp.partition)
                return busy
        except BacklogUnknown:
            raise
        except Exception as exc:  # noqa: BLE001 - any Kafka trouble: the answer is unknown
            raise BacklogUnknown(f"kafka lag query: {exc!r}") from exc

    def partition(self, topic: str, key: bytes) -> int:
        """The partition the default partitioner sends ``key`` to on ``topic`` (after a
        :meth:`busy_partitions` call has read the topic's partition count)."""
        return DefaultPartitioner()(key, self._partitions[topic], self._partitions[topic])

    def holder_may_be_queued(self, busy: dict[str, set[int]], key: bytes) -> bool:
        """True if a message keyed ``key`` could still be uncommitted in a watched topic."""
        return any(self.partition(topic, key) in busy.get(topic, set()) for topic, _ in self.watched)

    async def close(self) -> None:
        """Stop the Kafka clients (if started)."""
        if self._consumer is not None:
            await self._consumer.stop()
        if self._admin is not None:
            await self._admin.close()
        self._admin = self._consumer = None
