"""The runner's batcher rules (``max_batch``, ``max_wait_ms``) against an in-memory consumer (no Kafka).

The fake consumer releases records on a schedule (seconds after the test starts) and answers
``getmany`` as aiokafka does: at most ``max_records``, returning as soon as any record is there,
else after ``timeout_ms`` with nothing; paused partitions return nothing.

The time bounds here are correctness bounds with wide margins, not speed targets: a lone record
must wait for its batch to fill up to ``max_wait_ms`` (never less), and must not wait much longer.
"""

from __future__ import annotations

import asyncio
import time

from aiokafka import ConsumerRecord, TopicPartition

from services.common.kafka import Outgoing
from services.common.runner import Handler, StageRunner
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from tests.waits import until

P0 = TopicPartition("t", 0)


class ScheduledConsumer:
    """One partition whose record ``i`` becomes fetchable ``arrivals[i]`` seconds after ``start()``."""

    def __init__(self, arrivals: list[float]):
        self.arrivals = sorted(arrivals)
        self.pos = 0
        self.paused: set[TopicPartition] = set()
        self.committed = 0
        self.t0 = time.monotonic()
        self.fetched_at: dict[int, float] = {}  # offset -> monotonic time getmany returned it

    def start(self) -> None:
        self.t0 = time.monotonic()

    def assignment(self) -> set[TopicPartition]:
        return {P0}

    def pause(self, *tps: TopicPartition) -> None:
        self.paused |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused -= set(tps)

    def _due(self) -> int:
        """Records released by now and not yet fetched."""
        now = time.monotonic() - self.t0
        return sum(1 for t in self.arrivals[self.pos:] if t <= now)

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> dict:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            if P0 not in self.paused and self._due():
                n = min(self._due(), max_records or 1_000)
                now = time.monotonic()
                recs = [self._record(self.pos + i) for i in range(n)]
                for r in recs:
                    self.fetched_at[r.offset] = now
                self.pos += n
                return {P0: recs}
            left = deadline - time.monotonic()
            if left <= 0:
                await asyncio.sleep(0)
                return {}
            nxt = self.arrivals[self.pos] - (time.monotonic() - self.t0) if self.pos < len(self.arrivals) else left
            await asyncio.sleep(max(0.001, min(left, nxt, 0.005)))

    def _record(self, offset: int) -> ConsumerRecord:
        return ConsumerRecord(topic=P0.topic, partition=P0.partition, offset=offset, timestamp=0, timestamp_type=0,
                              key=None, value=b"%d" % offset, checksum=None, serialized_key_size=0,
                              serialized_value_size=1, headers=())

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.committed = offsets[P0]

    def highwater(self, tp: TopicPartition) -> int:
        return len(self.arrivals)

    async def position(self, tp: TopicPartition) -> int:
        return self.pos


class Recorder(Handler):
    """Records each batch's offsets and when ``handle`` got it; sleeps ``handle_s`` per batch."""

    def __init__(self, handle_s: float = 0.0):
        self.batches: list[list[int]] = []
        self.handed_at: list[float] = []
        self.handle_s = handle_s

    async def handle(self, records: list[ConsumerRecord]) -> list[Outgoing]:
        self.handed_at.append(time.monotonic())
        self.batches.append([r.offset for r in records])
        if self.handle_s:
            await asyncio.sleep(self.handle_s)
        return []

    def poison(self, record, exc, attempts):  # pragma: no cover - nothing fails here
        return []


async def run_until(consumer: ScheduledConsumer, handler: Recorder, max_batch: int, max_wait_ms: int,
                    cond, what: str, bound_s: float = 10.0) -> None:
    runner = StageRunner(stage="test", consumer=consumer, producer=None, handler=handler,  # type: ignore[arg-type]
                         telemetry=Telemetry("test", TelemetrySettings()), max_batch=max_batch,
                         max_wait_ms=max_wait_ms)
    stop = asyncio.Event()
    consumer.start()
    task = asyncio.create_task(runner.run(stop))
    try:
        await until(cond, what, bound_s)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_batch_never_exceeds_max_batch():
    """Bursts bigger than ``max_batch`` and a slow handler (so the next batch is carried while
    one runs): every batch holds 1..max_batch records, each record once, in order."""
    arrivals = [0.0] * 3 + [0.05] * 3 + [0.1] * 7 + [0.4] * 9 + [0.45] * 2
    consumer = ScheduledConsumer(arrivals)
    handler = Recorder(handle_s=0.25)
    await run_until(consumer, handler, max_batch=4, max_wait_ms=200,
                    cond=lambda: consumer.committed == len(arrivals), what="every offset committed")

    assert max(len(b) for b in handler.batches) == 4, handler.batches
    assert all(1 <= len(b) <= 4 for b in handler.batches), handler.batches
    assert [o for b in handler.batches for o in b] == list(range(len(arrivals)))


async def test_a_full_batch_does_not_wait_for_max_wait_ms():
    """Eight records at once with max_batch 4: two full batches go at once, though
    ``max_wait_ms`` is a minute (the bound below is a liveness bound)."""
    consumer = ScheduledConsumer([0.0] * 8)
    handler = Recorder()
    await run_until(consumer, handler, max_batch=4, max_wait_ms=60_000,
                    cond=lambda: consumer.committed == 8, what="both full batches handled and committed")

    assert handler.batches == [[0, 1, 2, 3], [4, 5, 6, 7]]


async def test_records_arriving_within_max_wait_ms_form_one_batch():
    """The first record opens a 1,500 ms window; three more arriving 100-300 ms later join its
    batch; one arriving 4 s later (well past the window) goes in a batch of its own."""
    consumer = ScheduledConsumer([0.0, 0.1, 0.2, 0.3, 4.0])
    handler = Recorder()
    await run_until(consumer, handler, max_batch=10, max_wait_ms=1500,
                    cond=lambda: consumer.committed == 5, what="all five records committed")

    assert handler.batches == [[0, 1, 2, 3], [4]]


async def test_a_lone_record_waits_for_its_batch_to_fill_then_goes():
    """A record with no companions is handed to the handler once ``max_wait_ms`` has passed
    since it was fetched: not before (its batch could still fill), and not much after."""
    wait_ms = 300
    consumer = ScheduledConsumer([0.2])
    handler = Recorder()
    await run_until(consumer, handler, max_batch=8, max_wait_ms=wait_ms,
                    cond=lambda: consumer.committed == 1, what="the lone record committed")

    assert handler.batches == [[0]]
    waited_ms = (handler.handed_at[0] - consumer.fetched_at[0]) * 1000
    assert waited_ms >= wait_ms - 5, f"handed after {waited_ms:.0f} ms, before max_wait_ms={wait_ms} ran out"
    assert waited_ms < wait_ms + 1500, f"handed after {waited_ms:.0f} ms (max_wait_ms={wait_ms})"
