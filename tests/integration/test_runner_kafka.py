"""The runner against the real broker: a batch longer than ``max.poll.interval.ms`` keeps the membership."""

from __future__ import annotations

import asyncio
import os

import orjson
from aiokafka import TopicPartition
from aiokafka.admin import NewTopic

from schemas.events import RequestEvent, ResultEvent
from schemas.reading import Line, Page
from services.common.dlq import oversized_result
from services.common.codec import dumps
from services.common.kafka import (
    BROKER_DEFAULT_MESSAGE_BYTES,
    Outgoing,
    create_topics,
    make_admin,
    make_consumer,
    make_producer,
    topic_message_limits,
)
from services.common.records import Record
from services.common.runner import Handler, Revocations, StageRunner
from services.common.settings import CommonSettings, TelemetrySettings
from services.common.telemetry import Telemetry

MAX_POLL_INTERVAL_MS = 3000  # a loaded machine may stall the test process for a second or more
LONG_BATCH_S = 3 * MAX_POLL_INTERVAL_MS / 1000


class SlowFirstBatch(Handler):
    """Records what it handles; the first batch takes ``LONG_BATCH_S`` (a GPU batch stand-in)."""

    def __init__(self):
        self.handled: list[int] = []

    async def handle(self, records: list[Record]) -> list[Outgoing]:
        if not self.handled:
            await asyncio.sleep(LONG_BATCH_S)
        self.handled += [r.offset for r in records]
        return []

    def poison(self, record, exc, attempts):  # pragma: no cover - nothing fails here
        return []


class EndsResults(SlowFirstBatch):
    """A stage whose results end requests (as infer's and dedup's do): an ``ok`` result too large
    for its topic ends its request as ``input_too_large``."""

    def oversize(self, msg, exc, stub):
        return [stub, *oversized_result(msg, exc)]


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


async def test_a_large_message_fits_and_one_over_its_topics_limit_becomes_a_dlq_stub(stack_env):
    """Topics made by ``create_topics`` take messages up to ``max_request_size`` (8 MiB; brokers
    default to 1 MiB): a 3 MiB result goes through whole. A topic made elsewhere with the 1 MiB
    limit would refuse it, and a refused batch leaves a gap in the idempotent producer's sequence
    numbers that fails every later send to the partition: the runner knows each topic's limit
    (``topic_message_limits``) and sends what ``Handler.oversize`` says instead (a small DLQ stub
    naming the message's request; with it, for a handler whose results end requests, the result as
    an error), before the broker sees it, so the messages after it on the same partition still go."""
    s = CommonSettings()
    ns = stack_env["OCRSTREAM_REDIS__KEY_PREFIX"]
    big, old, dlq = f"{ns}.big", f"{ns}.old-limit", f"{ns}.big-dlq"
    cfg = s.kafka.model_copy(update={"partitions": 1})
    await create_topics(cfg, [big, dlq])
    admin = make_admin(cfg, "test-big")
    await admin.start()
    try:
        await admin.create_topics([NewTopic(old, 1, 1, topic_configs={"max.message.bytes": str(1 << 20)})])
    finally:
        await admin.close()
    limits = await topic_message_limits(s.kafka, [big, old, dlq, f"{ns}.missing"])
    assert limits == {big: 8 << 20, old: 1 << 20, dlq: 8 << 20, f"{ns}.missing": BROKER_DEFAULT_MESSAGE_BYTES}
    producer = make_producer(s.kafka, "test-big")
    await producer.start()
    runner = StageRunner(stage="test", consumer=None, producer=producer, handler=EndsResults(),  # type: ignore[arg-type]
                         telemetry=Telemetry("test", TelemetrySettings()), dlq_topic=dlq, size_limits=limits)
    value = os.urandom(3 << 20)
    sha = "c" * 64
    line = Line(text="X" * 200, box=[[0, 0], [10, 0], [10, 10], [0, 10]], confidence=0.9)
    result = dumps(ResultEvent(request=RequestEvent(request_id="req-1", content_sha256=sha), cache_key=f"gen:{sha}",
                               status="ok", pages=[Page(index=1, width=10, height=10)], lines=[line] * 6000))
    assert len(result) > 1 << 20
    try:
        await asyncio.wait_for(runner._produce([
            Outgoing(big, "sha-1", value, []), Outgoing(old, "req-0", b"before", []),
            Outgoing(old, sha, result, []), Outgoing(old, "req-2", b"after", [])]), 60)
        await asyncio.wait_for(runner._produce([Outgoing(old, "req-3", b"next batch", [])]), 60)
    finally:
        await producer.stop()

    async def read(topic: str, n: int) -> list[bytes]:
        consumer = make_consumer(s.kafka, [topic], f"{ns}-read-{topic}", "test-big-read")
        await consumer.start()
        try:
            out: list[bytes] = []
            for _ in range(60):  # until the n messages are there, 60 s at most (a group join on a loaded machine)
                got = await consumer.getmany(timeout_ms=1000)
                out += [r.value for recs in got.values() for r in recs]
                if len(out) >= n:
                    break
            return out
        finally:
            await consumer.stop()

    assert await read(big, 1) == [value]
    before, failed, after, nxt = await read(old, 4)
    assert (before, after, nxt) == (b"before", b"after", b"next batch")
    # the oversized ok result goes on as the same result failed with input_too_large, without its
    # lines, so its request and the copies waiting on it get a final state
    failed = orjson.loads(failed)
    assert failed["status"] == "error" and failed["error"]["code"] == "input_too_large" and failed["lines"] == []
    assert failed["request"]["request_id"] == "req-1" and failed["cache_key"] == f"gen:{sha}"
    [stub] = [orjson.loads(v) for v in await read(dlq, 1)]
    # named by its request, not by its key (the content hash)
    assert stub["topic"] == old and stub["request_id"] == "req-1" and stub["error_code"] == "input_too_large"
    assert "too large" in stub["reason"].lower()
