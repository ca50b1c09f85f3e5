"""Test helpers that read the pipeline's topics and a consumer group's committed offsets directly
(the integration and fault tests of the infer window and of poison records)."""

from __future__ import annotations

import asyncio
import hashlib
import time

from aiokafka import TopicPartition
from aiokafka.partitioner import murmur2

from schemas.events import DlqEvent
from services.common.kafka import make_consumer
from services.common.settings import CommonSettings


def partition_of(image: bytes, partitions: int = 4) -> int:
    """The ``ocr.infer`` (or ``ocr.infer-interactive``) partition of an image: its key is the
    content SHA-256 (hex), placed by the producer's default partitioner (murmur2, as Kafka's Java client)."""
    return (murmur2(hashlib.sha256(image).hexdigest().encode()) & 0x7FFFFFFF) % partitions


async def topic_records(topic: str, partition: int | None = None) -> list:
    """Every record of ``topic`` (of one partition, or all), from the beginning to the current end."""
    s = CommonSettings()
    consumer = make_consumer(s.kafka, [], None, "test-topic-reader")
    await consumer.start()
    try:
        parts = [partition] if partition is not None else sorted(consumer.partitions_for_topic(topic) or set())
        tps = [TopicPartition(topic, p) for p in parts]
        assert tps, f"no partitions known for {topic}"
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        out: list = []
        while any([await consumer.position(tp) < end[tp] for tp in tps]):
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                out += recs
        return out
    finally:
        await consumer.stop()


async def committed(group: str, topic: str) -> dict[int, int]:
    """``group``'s committed offset per partition of ``topic`` (0 where none)."""
    s = CommonSettings()
    consumer = make_consumer(s.kafka, [], group, "test-committed-reader")  # never joins
    await consumer.start()
    try:
        parts = sorted(consumer.partitions_for_topic(topic) or set())
        return {p: (await consumer.committed(TopicPartition(topic, p))) or 0 for p in parts}
    finally:
        await consumer.stop()


async def lag(group: str, topic: str, bound_s: float = 120) -> dict[int, int]:
    """``group``'s lag per partition of ``topic`` once every one is 0 (or at ``bound_s``; 0: now)."""
    s = CommonSettings()
    consumer = make_consumer(s.kafka, [], group, "test-lag-reader")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, n) for n in consumer.partitions_for_topic(topic) or set()]
        deadline = time.monotonic() + bound_s
        while True:
            end = await consumer.end_offsets(tps)
            out = {tp.partition: end[tp] - ((await consumer.committed(tp)) or 0) for tp in tps}
            if not any(out.values()) or time.monotonic() >= deadline:
                return out
            await asyncio.sleep(0.5)
    finally:
        await consumer.stop()


async def dlq_events(bound_s: float = 60) -> list[DlqEvent]:
    """Every event on ``ocr.dlq``, waiting up to ``bound_s`` seconds for the first one."""
    s = CommonSettings()
    consumer = make_consumer(s.kafka, [], None, "test-dlq-reader")
    await consumer.start()
    try:
        tps = [TopicPartition(s.topics.dlq, n) for n in consumer.partitions_for_topic(s.topics.dlq) or set()]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[DlqEvent] = []
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            got = False
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                out += [DlqEvent.model_validate_json(r.value) for r in recs]
                got = True
            if out and not got:
                break
        return out
    finally:
        await consumer.stop()
