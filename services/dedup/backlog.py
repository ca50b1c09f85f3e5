"""Is a lease holder still on its way? The backlog of the stages after dedup, read from Kafka.

A lease holder's event is never lost while it travels: dedup commits its ``ocr.requests`` offset
only after ``ocr.infer`` has the holder's event, infer commits only after ``ocr.results`` has the
result, and the sink commits only after it has completed the key. So until the key is
completed, the holder's message sits in ``ocr.infer`` or ``ocr.results`` at or after the
consuming group's committed offset. If the group that reads a topic has committed everything on
the partition the holder's key maps to, the holder is not queued there.

Dedup's reaper uses this before it replaces a holder whose lease deadline has passed. It does not
wait for a partition to be empty (under steady traffic it never is); it takes marks: when the
deadline first passes, the end offset of the key's ``ocr.infer`` partition (the holder's event is
before it); once the infer group has committed past that mark, the end offset of the key's
``ocr.results`` partition (the holder's result is before it); once the sink group has committed
past that, the holder's result has been handled, and if the key is still not completed its
completion was lost (a sink that died holding a completion it deferred while Redis was down, or
Redis data lost): only then is a waiter promoted. Until then the lease is extended, so a backlog
longer than ``OCRSTREAM_LEASE_MS`` (or a stopped infer) never makes copies of one image into
several inferences.
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
    """End and committed offsets of the watched topics' partitions, and which partition a key maps to.

    Args:
        cfg: Kafka connection settings.
        watched: ``(topic, consumer group)`` pairs, e.g. ``[("ocr.infer", "ocrstream-infer"),
            ("ocr.results", "ocrstream-sink")]``.
        timeout_s: Time budget of one :meth:`offsets` call, s.

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

    async def offsets(self) -> dict[str, tuple[dict[int, int], dict[int, int]]]:
        """For each watched topic, every partition's end offset and its group's committed offset
        (a partition the group never committed counts as committed up to its first offset).

        Returns:
            Topic -> ``(end offsets, committed offsets)``, each partition -> offset.

        Raises:
            BacklogUnknown: Kafka errored or did not answer within ``timeout_s``; the caller
                must then assume the holder may still be on its way.
        """
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._start()
                out: dict[str, tuple[dict[int, int], dict[int, int]]] = {}
                for topic, group in self.watched:
                    tps = [TopicPartition(topic, p) for p in self._partitions[topic]]
                    if not tps:
                        raise BacklogUnknown(f"topic {topic} has no partitions in the metadata")
                    committed = await self._admin.list_consumer_group_offsets(group, partitions=tps)
                    ends = await self._consumer.end_offsets(tps)
                    starts = await self._consumer.beginning_offsets(tps)
                    done = {}
                    for tp in tps:
                        meta = committed.get(tp)
                        done[tp.partition] = meta.offset if meta is not None and meta.offset >= 0 else starts[tp]
                    out[topic] = ({tp.partition: ends[tp] for tp in tps}, done)
                return out
        except BacklogUnknown:
            raise
        except Exception as exc:  # noqa: BLE001 - any Kafka trouble: the answer is unknown
            raise BacklogUnknown(f"kafka offsets query: {exc!r}") from exc

    def partition(self, topic: str, key: bytes) -> int:
        """The partition the default partitioner sends ``key`` to on ``topic`` (after an
        :meth:`offsets` call has read the topic's partition count)."""
        return DefaultPartitioner()(key, self._partitions[topic], self._partitions[topic])

    async def close(self) -> None:
        """Stop the Kafka clients (if started)."""
        if self._consumer is not None:
            await self._consumer.stop()
        if self._admin is not None:
            await self._admin.close()
        self._admin = self._consumer = None
