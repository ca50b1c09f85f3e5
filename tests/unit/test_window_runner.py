"""The window runner (services/infer/window.py) against an in-memory consumer (no Kafka).

The fake consumer follows the aiokafka behaviour the runner relies on: records come in offset
order per partition, ``getmany(*partitions)`` takes only those partitions, paused partitions
return nothing, a (re)assigned partition is fetched again from its committed offset, and
``commit`` takes ``OffsetAndMetadata`` values (kept, with their metadata, as the group's). Every
wait in these tests is on an event or a condition with a liveness bound, never on a duration.
"""

from __future__ import annotations

import asyncio

import orjson
from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import IllegalStateError
from aiokafka.structs import OffsetAndMetadata

from services.common.kafka import Outgoing
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from services.infer.progress import PartitionProgress, read_metadata, write_metadata
from services.infer.window import WindowHandler, WindowRunner
from tests.waits import until

B0, B1, I0 = TopicPartition("bulk", 0), TopicPartition("bulk", 1), TopicPartition("inter", 0)


class FakeConsumer:
    """``n[tp]`` records per partition, value ``b"<topic>/<partition>/<offset>"``."""

    def __init__(self, n: dict[TopicPartition, int]):
        self.n = dict(n)
        self.assigned = set(n)
        self.paused: set[TopicPartition] = set()
        self.pos = dict.fromkeys(n, 0)
        self.committed: dict[TopicPartition, OffsetAndMetadata] = {}
        self.commits: list[dict[TopicPartition, OffsetAndMetadata]] = []
        self.seeks: list[tuple[TopicPartition, int]] = []

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def pause(self, *tps: TopicPartition) -> None:
        self.paused |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused -= set(tps)

    async def getmany(self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None) -> dict:
        await asyncio.sleep(0)
        out: dict[TopicPartition, list[ConsumerRecord]] = {}
        left = max_records or 1_000
        wanted = set(partitions) if partitions else self.assigned
        progress = True
        while left and progress:
            progress = False
            for tp in sorted(wanted & self.assigned - self.paused):
                if left and self.pos[tp] < self.n[tp]:
                    out.setdefault(tp, []).append(self._record(tp, self.pos[tp]))
                    self.pos[tp] += 1
                    left -= 1
                    progress = True
        if not out and timeout_ms:
            await asyncio.sleep(min(timeout_ms, 10) / 1000)
        return out

    @staticmethod
    def _record(tp: TopicPartition, offset: int) -> ConsumerRecord:
        value = f"{tp.topic}/{tp.partition}/{offset}".encode()
        return ConsumerRecord(topic=tp.topic, partition=tp.partition, offset=offset, timestamp=0, timestamp_type=0,
                              key=None, value=value, checksum=None, serialized_key_size=0,
                              serialized_value_size=len(value), headers=())

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))
        self.pos[tp] = offset

    async def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        for tp in offsets:
            if tp not in self.assigned:
                raise IllegalStateError(f"Partition {tp} is not assigned")
        self.commits.append(dict(offsets))
        self.committed.update(offsets)

    def offset(self, tp: TopicPartition) -> int:
        om = self.committed.get(tp)
        return om.offset if om is not None else 0

    async def read_committed(self, tps):
        return {tp: self.committed[tp] for tp in tps if tp in self.committed}

    async def rebalance(self, listener, revoked: set[TopicPartition], assigned: set[TopicPartition]) -> None:
        await listener.on_partitions_revoked(revoked)
        for tp in assigned:
            if tp in revoked or tp not in self.assigned:
                self.pos[tp] = self.offset(tp)
        self.assigned = set(assigned)
        self.paused -= revoked
        await listener.on_partitions_assigned(set(assigned))

    def highwater(self, tp: TopicPartition) -> int:
        return self.n[tp]

    async def position(self, tp: TopicPartition) -> int:
        return self.pos[tp]


class Gated(WindowHandler):
    """Records every start and end; a record whose value is in ``gates`` waits for its event."""

    def __init__(self, gates: dict[str, asyncio.Event] | None = None):
        self.gates = gates or {}
        self.started: list[str] = []
        self.ended: list[str] = []
        self.running = 0
        self.most = 0  # records in handle_record at once, at most
        self.overlapped: set[str] = set()  # records that ran while another was running

    def lane(self, topic: str) -> str:
        return "interactive" if topic == "inter" else "bulk"

    async def handle_record(self, record) -> list[Outgoing]:
        name = record.value.decode()
        self.started.append(name)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if self.running > 1:
                self.overlapped.add(name)
            gate = self.gates.get(name)
            if gate is not None:
                await gate.wait()
            else:
                await asyncio.sleep(0)
            if self.running > 1:
                self.overlapped.add(name)
        finally:
            self.running -= 1
        self.ended.append(name)
        return []

    def poison(self, record, exc, attempts):
        self.ended.append(f"poison:{record.value.decode()}:{exc}")
        return []


def make_runner(consumer: FakeConsumer, handler: Gated, window: int, reserve: int = 0,
                poison_after: int = 0) -> WindowRunner:
    return WindowRunner(stage="test", consumer=consumer, producer=None, handler=handler,  # type: ignore[arg-type]
                        telemetry=Telemetry("test", TelemetrySettings()), max_in_flight=window,
                        interactive_reserve=reserve, poison_after_deaths=poison_after,
                        read_committed=consumer.read_committed, commit_interval_s=0.0)


class Running:
    """A runner's loop in the background: ``async with Running(runner):``."""

    def __init__(self, runner: WindowRunner, assign: bool = True):
        self.runner, self.assign = runner, assign
        self.stop = asyncio.Event()

    async def __aenter__(self):
        if self.assign:  # as aiokafka does on the first join
            await self.runner.listener.on_partitions_assigned(self.runner.consumer.assignment())
        self.task = asyncio.create_task(self.runner.run(self.stop))
        return self

    async def __aexit__(self, *exc):
        self.stop.set()
        await asyncio.wait_for(self.task, 10)


async def test_a_slow_record_holds_back_nothing_behind_it_and_the_commit_stays_below_it():
    slow = asyncio.Event()
    consumer = FakeConsumer({B0: 10})
    handler = Gated({"bulk/0/0": slow})
    runner = make_runner(consumer, handler, window=4)
    async with Running(runner):
        await until(lambda: len(handler.ended) == 9, "every record behind the slow one done")
        await until(lambda: consumer.committed.get(B0) is not None and "done" in consumer.committed[B0].metadata,
                    "a commit naming what is done above the watermark")
        assert consumer.offset(B0) == 0  # the watermark: the slow record is not done
        c = read_metadata(0, consumer.committed[B0].metadata)
        assert c.done == set(range(1, 10)) and c.running == {0}
        slow.set()
        await until(lambda: consumer.offset(B0) == 10, "the watermark past every record")
    assert handler.ended[-1] == "bulk/0/0" and sorted(handler.started) == sorted(handler.ended)
    assert read_metadata(10, consumer.committed[B0].metadata).running == set()


async def test_never_more_records_in_flight_than_the_window():
    gates = {f"bulk/{p}/{o}": asyncio.Event() for p in (0, 1) for o in range(20)}
    consumer = FakeConsumer({B0: 20, B1: 20})
    handler = Gated(gates)
    runner = make_runner(consumer, handler, window=5)
    async with Running(runner):
        await until(lambda: handler.running == 5, "the window full")
        for _ in range(3):  # the window stays at 5 while records end one at a time
            await asyncio.sleep(0.02)
            assert handler.running == 5
            gates[handler.started[len(handler.ended)]].set()
            await until(lambda: handler.running == 5 or len(handler.started) == 40, "the freed slot refilled")
        for g in gates.values():
            g.set()
        await until(lambda: consumer.offset(B0) == 20 and consumer.offset(B1) == 20, "every record committed")
    assert handler.most == 5 and len(handler.ended) == 40


async def test_interactive_records_go_first_and_keep_their_reserve_under_a_bulk_flood():
    gates = {f"bulk/0/{o}": asyncio.Event() for o in range(50)}
    consumer = FakeConsumer({B0: 50, I0: 0})
    handler = Gated(gates)
    runner = make_runner(consumer, handler, window=4, reserve=1)
    async with Running(runner):
        await until(lambda: len(handler.started) == 3, "bulk fills its share")
        await asyncio.sleep(0.05)
        assert handler.running == 3  # bulk holds at most window - reserve
        consumer.n[I0] = 2  # two interactive records arrive while bulk waits
        await until(lambda: sum(s.startswith("inter") for s in handler.ended) == 2, "the interactive records done")
        # bulk records still waiting: none of them started before the interactive ones
        assert len(handler.started) == 5 and handler.started[3:] == ["inter/0/0", "inter/0/1"]
        for g in gates.values():
            g.set()
        await until(lambda: consumer.offset(B0) == 50 and consumer.offset(I0) == 2, "everything committed")


async def test_bulk_keeps_the_reserve_under_an_interactive_flood():
    gates = {f"inter/0/{o}": asyncio.Event() for o in range(50)}
    consumer = FakeConsumer({B0: 3, I0: 50})
    handler = Gated(gates)
    runner = make_runner(consumer, handler, window=4, reserve=1)
    async with Running(runner):
        # interactive holds at most 3 slots; the fourth goes to bulk, which finishes all 3
        await until(lambda: sum(s.startswith("bulk") for s in handler.ended) == 3, "bulk done under the flood")
        assert sum(s.startswith("inter") for s in handler.ended) == 0
        for g in gates.values():
            g.set()
        await until(lambda: consumer.offset(I0) == 50, "the flood committed")


async def test_a_revoked_partition_commits_nothing_past_its_watermark_and_a_record_back_here_is_not_read_twice():
    slow = asyncio.Event()
    consumer = FakeConsumer({B0: 6, B1: 6})
    handler = Gated({"bulk/1/1": slow})
    runner = make_runner(consumer, handler, window=8)
    async with Running(runner):
        await until(lambda: len(handler.ended) == 11, "all but the slow record done")
        await until(lambda: consumer.offset(B1) == 1, "B1's watermark at the slow record")
        # eager rebalance: both revoked; B1 comes straight back
        await consumer.rebalance(runner.listener, revoked={B0, B1}, assigned={B0, B1})
        # the revocation committed B1 at its watermark with what is done above it, nothing running
        c = read_metadata(consumer.offset(B1), consumer.committed[B1].metadata)
        assert consumer.offset(B1) == 1 and c.running == set() and c.done == set(range(2, 6))
        await until(lambda: consumer.pos[B1] == 6 and runner._running["bulk"] == 2,
                    "B1 fetched again, its record 1 started beside its earlier copy")
        slow.set()
        await until(lambda: consumer.offset(B0) == 6 and consumer.offset(B1) == 6, "both partitions committed")
    # B1's record 1 was in flight when B1 came back: fetched again, it waited for its copy (one
    # handling); the records done above the watermark were skipped, not read again
    assert handler.started.count("bulk/1/1") == 1
    assert all(handler.started.count(f"bulk/1/{o}") == 1 for o in range(6))


async def test_a_record_running_at_a_death_runs_alone_and_one_at_the_limit_is_poisoned_unhandled():
    consumer = FakeConsumer({B0: 8})
    # a death: offsets 2 and 3 were running, 3 already at one death, 4 done, committed at 2
    consumer.committed[B0] = OffsetAndMetadata(2, write_metadata(2, {2, 3}, {4}, {3: 1}))
    handler = Gated()
    runner = make_runner(consumer, handler, window=4, poison_after=2)
    consumer.pos[B0] = 2
    async with Running(runner):
        await until(lambda: consumer.offset(B0) == 8, "the partition committed to its end")
    assert "bulk/0/2" not in handler.overlapped  # the suspect ran with nothing else in flight
    assert handler.started.count("bulk/0/2") == 1
    assert "bulk/0/3" not in handler.started  # two deaths: not handled
    assert any(e.startswith("poison:bulk/0/3:") and "died 2 times" in e for e in handler.ended)
    assert "bulk/0/4" not in handler.started  # done before the death: skipped
    assert set(handler.started) == {"bulk/0/2", "bulk/0/5", "bulk/0/6", "bulk/0/7"}


async def test_records_wait_for_their_running_mark_when_deaths_are_counted():
    consumer = FakeConsumer({B0: 3})
    seen: list[set[int]] = []

    class Checking(Gated):
        async def handle_record(self, record):
            # the group's committed metadata names this record running before it is handled
            om = consumer.committed.get(B0)
            seen.append(read_metadata(om.offset, om.metadata).running if om else set())
            assert record.offset in seen[-1]
            return await super().handle_record(record)

    handler = Checking()
    runner = make_runner(consumer, handler, window=2, poison_after=2)
    async with Running(runner):
        await until(lambda: consumer.offset(B0) == 3, "committed")
    assert len(seen) == 3


async def test_records_fetched_before_their_assignment_is_registered_are_fetched_again():
    """aiokafka may hand out records of a new assignment before on_partitions_assigned has run:
    they are not counted under a progress that does not know the partition's commit metadata;
    the partition is sought back and they come again once it is registered."""
    consumer = FakeConsumer({B0: 4})
    handler = Gated()
    runner = make_runner(consumer, handler, window=4)
    async with Running(runner, assign=False):
        await until(lambda: consumer.seeks, "the early records sought back")
        assert handler.started == []
        await runner.listener.on_partitions_assigned({B0})
        await until(lambda: consumer.offset(B0) == 4, "committed once registered")
    assert handler.started == [f"bulk/0/{o}" for o in range(4)] and consumer.seeks[0] == (B0, 0)


def test_the_watermark_is_the_first_record_not_done():
    prog = PartitionProgress(B0)
    for o in (5, 6, 8, 9):  # offsets need not be contiguous
        prog.fetched(o)
    assert prog.watermark == 5
    prog.finished(6)
    prog.finished(9)
    assert prog.watermark == 5
    prog.finished(5)
    assert prog.watermark == 8
    prog.finished(8)
    assert prog.watermark == 10


def test_metadata_round_trips_and_stays_under_its_bound():
    meta = write_metadata(100, {100, 101, 105}, {102, 103, 106}, {100: 1, 101: 1})
    assert orjson.loads(meta) == {"ocrstream": 2, "running": [[0, 1], [5, 5]], "done": [[2, 3], [6, 6]],
                                  "deaths": [[0, 1, 1]]}
    c = read_metadata(100, meta)
    assert (c.running, c.done, c.deaths) == ({100, 101, 105}, {102, 103, 106}, {100: 1, 101: 1})
    # scattered: done runs are dropped first, then running becomes one span
    big = write_metadata(0, set(range(0, 4000, 2)), set(range(1, 4000, 2)), {})
    assert len(big) <= 2048
    c = read_metadata(0, big)
    assert c.done == set() and c.running == set(range(0, 3999))
    assert read_metadata(7, "") == read_metadata(7, "not ours")
    # the batch runner's marks (version 1) are read too
    v1 = read_metadata(120, '{"ocrstream":1,"in_progress":[120,122],"deaths":[[121,121,1]]}')
    assert v1.running == {120, 121, 122} and v1.deaths == {121: 1}
