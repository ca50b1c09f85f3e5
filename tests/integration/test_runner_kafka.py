"""The runner against the real broker: a batch longer than ``max.poll.interval.ms`` keeps the membership."""

from __future__ import annotations

import asyncio

from aiokafka import ConsumerRecord, TopicPartition

from services.common.kafka import Outgoing, create_topics, make_consumer, make_producer
from services.common.runner import Handler, Revocations, StageRunner
from services.common.settings import CommonSettings, TelemetrySettings
from services.common.telemetry import Telemetry

MAX_POLL_INTERVAL_MS = 1500
LONG_BATCH_S = 3 * MAX_POLL_INTERVAL_MS / 1000


class SlowFirstBatch(Handler):
    """Records what it handles; the first batch takes ``LONG_BATCH_S`` (a GPU batch stand-in)."""

    def __init__(self):
        self.handled: list[int] = []

    async def handle(self, records: list[ConsumerRecord]) -> list[Outgoing]:
        if not self.handled:
            await asyncio.sleep(LONG_BATCH_S)
        self.handled += [r.offset for r in records]
        return []

    def poison(self, record, exc, attempts):  # pragma: no cover - nothing fails here
        return []


class CountingRevocations(Revocations):
    """The runner's listener, counting revocations that took partitions away."""

    def __init__(self, runner: StageRunner):
        super().__init__(runner)
        self.revoked: list[set[TopicPartition]] = []

    async def on_partitions_revoked(self, revoked):
        if revoked:
            self.revoked.append(set(revoked))
        await super().on_partitions_revoked(revoked)


async def test_batch_longer_than_max_poll_interval_keeps_the_membership(stack_env):
    """aiokafka leaves the group when no ``getmany`` ran for ``max_poll_interval_ms``
    (``GroupCoordinator._heartbeat_routine``, ``fetcher_idle_time``); the runner keeps polling with
    the partition paused, so nothing is revoked and nothing is handled twice."""
    s = CommonSettings()
    ns = stack_env["OCRSTREAM_REDIS__KEY_PREFIX"]
    topic, group = f"{ns}.keepalive", f"{ns}-keepalive"
    await create_topics(s.kafka.model_copy(update={"partitions": 1}), [topic])
    producer = make_producer(s.kafka, "test-keepalive")
    await producer.start()
    try:
        for i in range(6):
            await producer.send_and_wait(topic, b"%d" % i)
    finally:
        await producer.stop()

    consumer = make_consumer(s.kafka, [], group, "test-keepalive", max_poll_interval_ms=MAX_POLL_INTERVAL_MS)
    handler = SlowFirstBatch()
    runner = StageRunner(stage="test", consumer=consumer, producer=None, handler=handler,  # type: ignore[arg-type]
                         telemetry=Telemetry("test", TelemetrySettings()), max_batch=2, max_wait_ms=0)
    listener = CountingRevocations(runner)
    consumer.subscribe([topic], listener=listener)
    await consumer.start()
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    tp = TopicPartition(topic, 0)
    try:
        for _ in range(240):  # liveness bound: 60 s
            if await consumer.committed(tp) == 6:
                break
            await asyncio.sleep(0.25)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await consumer.stop()

    assert await _committed(s, group, tp) == 6
    assert handler.handled == [0, 1, 2, 3, 4, 5]  # each once, in order: no redelivery
    assert listener.revoked == []  # the membership held through the long batch


async def _committed(s: CommonSettings, group: str, tp: TopicPartition) -> int | None:
    consumer = make_consumer(s.kafka, [], group, "test-keepalive-offsets")
    await consumer.start()
    try:
        return await consumer.committed(tp)
    finally:
        await consumer.stop()
