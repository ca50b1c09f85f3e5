"""The runner's rebalance and keep-alive logic, against an in-memory consumer (no Kafka).

The fake consumer follows the aiokafka behaviour the runner relies on: records come in offset
order per partition, paused partitions return nothing, a (re)assigned partition is fetched again
from its committed offset, and ``commit`` raises ``IllegalStateError`` for a partition that is not
assigned. A rebalance is driven by the test: revoke callback, new assignment, assign callback.
"""

from __future__ import annotations

import asyncio

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import IllegalStateError

from services.common.kafka import Outgoing
from services.common.runner import Handler, StageRunner
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from tests.waits import until

P0, P1 = TopicPartition("t", 0), TopicPartition("t", 1)


class FakeConsumer:
    """``n`` records per partition; each fetch stamps the record's value with the assignment
    generation it was fetched under (``b"g<gen>"``)."""

    def __init__(self, n: int, partitions: tuple[TopicPartition, ...] = (P0, P1)):
        self.n = n
        self.gen = 1
        self.assigned = set(partitions)
        self.paused: set[TopicPartition] = set()
        self.pos = {tp: 0 for tp in partitions}
        self.committed = {tp: 0 for tp in partitions}
        self.commits: list[dict[TopicPartition, int]] = []
        self.paused_polls = 0  # getmany calls made while every assigned partition was paused

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def pause(self, *tps: TopicPartition) -> None:
        self.paused |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused -= set(tps)

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> dict:
        if self.assigned and self.assigned <= self.paused:
            self.paused_polls += 1
        await asyncio.sleep(0)
        out: dict[TopicPartition, list[ConsumerRecord]] = {}
        left = max_records or 1_000
        progress = True
        while left and progress:  # round robin, one record at a time
            progress = False
            for tp in sorted(self.assigned - self.paused):
                if left and self.pos[tp] < self.n:
                    out.setdefault(tp, []).append(self._record(tp, self.pos[tp]))
                    self.pos[tp] += 1
                    left -= 1
                    progress = True
        if not out and timeout_ms:
            await asyncio.sleep(min(timeout_ms, 20) / 1000)
        return out

    def _record(self, tp: TopicPartition, offset: int) -> ConsumerRecord:
        return ConsumerRecord(topic=tp.topic, partition=tp.partition, offset=offset, timestamp=0, timestamp_type=0,
                              key=None, value=b"g%d" % self.gen, checksum=None, serialized_key_size=0,
                              serialized_value_size=2, headers=())

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        for tp in offsets:
            if tp not in self.assigned:
                raise IllegalStateError(f"Partition {tp} is not assigned")
        self.commits.append(dict(offsets))
        self.committed.update(offsets)

    async def rebalance(self, listener, revoked: set[TopicPartition], assigned: set[TopicPartition]) -> None:
        """Revoke ``revoked``, then assign ``assigned`` (fetched again from their committed offsets)."""
        await listener.on_partitions_revoked(revoked)
        self.gen += 1
        for tp in assigned - (self.assigned - revoked):
            self.pos[tp] = self.committed[tp]
        self.assigned = set(assigned)
        self.paused -= revoked
        await listener.on_partitions_assigned(set(assigned))

    def highwater(self, tp: TopicPartition) -> int:
        assert tp in self.assigned, "Partition is not assigned"  # as aiokafka's
        return self.n

    async def position(self, tp: TopicPartition) -> int:
        return self.pos[tp]


def key(r: ConsumerRecord) -> tuple[int, int, bytes]:
    return (r.partition, r.offset, r.value)


class Recorder(Handler):
    """Records every batch; ``hooks[i]`` (if any) is awaited inside the i-th ``handle`` call."""

    def __init__(self, hooks: dict | None = None):
        self.batches: list[list[tuple[int, int, bytes]]] = []
        self.prefetched: list[tuple[int, int, bytes]] = []
        self.forgotten: list[tuple[int, int, bytes]] = []
        self.hooks = hooks or {}

    async def handle(self, records: list[ConsumerRecord]) -> list[Outgoing]:
        self.batches.append([key(r) for r in records])
        hook = self.hooks.get(len(self.batches) - 1)
        if hook is not None:
            await hook(records)
        return []

    def poison(self, record, exc, attempts):  # pragma: no cover - nothing fails here
        return []

    def prefetch(self, records: list[ConsumerRecord]) -> None:
        self.prefetched.extend(key(r) for r in records)

    def forget(self, records: list[ConsumerRecord]) -> None:
        self.forgotten.extend(key(r) for r in records)


async def run_until(runner: StageRunner, cond, what: str) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        await until(cond, what)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def make_runner(consumer: FakeConsumer, handler: Recorder, max_batch: int) -> StageRunner:
    runner = StageRunner(stage="test", consumer=consumer, producer=None, handler=handler,  # type: ignore[arg-type]
                         telemetry=Telemetry("test", TelemetrySettings()), max_batch=max_batch, max_wait_ms=0)
    return runner


async def test_revoked_partition_is_not_committed_for_the_batch_in_flight_even_when_it_comes_back():
    consumer = FakeConsumer(n=6)

    async def rebalance_mid_batch(records):
        # the next batch is carried (and prefetched) while this one runs ...
        await until(lambda: len(handler.prefetched) == 4, "the next batch carried during the first")
        # ... then P1 is revoked and comes straight back (fetched again from its committed offset 0)
        await consumer.rebalance(runner.listener, revoked={P1}, assigned={P0, P1})

    handler = Recorder({0: rebalance_mid_batch})
    runner = make_runner(consumer, handler, max_batch=4)
    await run_until(runner, lambda: consumer.committed == {P0: 6, P1: 6}, "every offset committed")

    assert handler.batches[0] == [(0, 0, b"g1"), (0, 1, b"g1"), (1, 0, b"g1"), (1, 1, b"g1")]
    # the batch in flight committed P0 only, though P1 was assigned again by then
    assert consumer.commits[0] == {P0: 2}
    # the carried P1 records were dropped and their prefetches forgotten; P0's were kept
    assert handler.prefetched == [(0, 2, b"g1"), (0, 3, b"g1"), (1, 2, b"g1"), (1, 3, b"g1")]
    assert handler.forgotten == [(1, 2, b"g1"), (1, 3, b"g1")]
    later = [k for batch in handler.batches[1:] for k in batch]
    # nothing fetched before the revocation was handled after it for P1; P1 was redone from offset 0
    assert [k for k in later if k[0] == 1] == [(1, i, b"g2") for i in range(6)]
    assert [k[:2] for k in later if k[0] == 0] == [(0, i) for i in range(2, 6)]  # P0 kept: each once
    # no commit ever went past an offset not handled under the assignment the commit was made in
    for c in consumer.commits:
        if P1 in c:
            assert all((1, i, b"g2") in later for i in range(c[P1]))


async def test_partitions_no_longer_assigned_are_never_committed():
    consumer = FakeConsumer(n=4)

    async def move_p1_away(records):
        await until(lambda: len(handler.prefetched) == 2, "the next batch carried")
        # eager protocol: everything is revoked, P0 comes back, P1 goes to another consumer
        await consumer.rebalance(runner.listener, revoked={P0, P1}, assigned={P0})

    handler = Recorder({0: move_p1_away})
    runner = make_runner(consumer, handler, max_batch=2)
    await run_until(runner, lambda: consumer.committed[P0] == 4, "P0 committed to its end")

    assert handler.batches[0] == [(0, 0, b"g1"), (1, 0, b"g1")]
    assert handler.forgotten == [(0, 1, b"g1"), (1, 1, b"g1")]  # the carry, both partitions
    assert all(P1 not in c for c in consumer.commits)  # no IllegalStateError swallowed, no P1 commit
    assert consumer.committed[P1] == 0
    assert [k for b in handler.batches[1:] for k in b] == [(0, i, b"g2") for i in range(4)]


async def test_long_batch_keeps_polling_with_partitions_paused():
    """A batch that outlasts ``max.poll.interval.ms``: aiokafka leaves the group when no
    ``getmany`` ran for that long (``fetcher_idle_time``), so the runner must keep calling it
    while the handler runs, with the partitions paused once the carry buffer is full."""
    consumer = FakeConsumer(n=10, partitions=(P0,))

    held: list[list[tuple[int, int, bytes]]] = []  # records fetched meanwhile, at the end of the first batch

    async def long_batch(records):
        # the handler only finishes once the runner has polled 5 times with everything paused
        await until(lambda: consumer.paused_polls >= 5, "getmany called while paused")
        held.append(list(handler.prefetched))

    handler = Recorder({0: long_batch})
    runner = make_runner(consumer, handler, max_batch=2)
    await run_until(runner, lambda: consumer.committed == {P0: 10}, "every offset committed")

    # the runner's bound: while a batch runs it holds at most one more batch (max_batch records)
    # beyond it, then pauses; 8 more records were there to fetch
    assert held == [[(0, 2, b"g1"), (0, 3, b"g1")]]
    assert consumer.pos[P0] == 10
    handled = [k for b in handler.batches for k in b]
    assert handled == [(0, i, b"g1") for i in range(10)]  # each record once, in order
    assert consumer.paused == set()  # resumed after the batch


async def test_lag_report_survives_a_rebalance_between_partitions():
    """aiokafka's ``highwater`` asserts the partition is assigned; a rebalance can land while the
    lag report awaits ``position`` of an earlier partition."""
    consumer = FakeConsumer(n=3)
    runner = make_runner(consumer, Recorder(), max_batch=2)

    async def position_then_rebalance(tp):
        if consumer.gen == 1:  # the first partition asked: the other one moves away meanwhile
            await consumer.rebalance(runner.listener, revoked={P0, P1}, assigned={tp})
        return consumer.pos[tp]

    consumer.position = position_then_rebalance  # type: ignore[method-assign]
    await runner._report_lag()  # must not raise
