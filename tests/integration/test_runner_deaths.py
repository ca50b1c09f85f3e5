"""Records in progress when a stage died are counted across restarts (real Kafka, real processes).

The stage processes are :mod:`tests.dying_stage`: the real stage lifecycle and runner over a
topic of this test's own, with a handler that SIGKILLs its process while it holds a ``kill:``
record. Deaths live only in the consumer group's commit metadata, read back here with the admin
client as the runner reads it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

from aiokafka import TopicPartition

from schemas.errors import ErrorCode
from schemas.events import DlqEvent
from services.common.deaths import decode
from services.common.kafka import create_topics, make_admin, make_consumer, make_producer
from services.common.runner import Handler, StageRunner
from services.common.settings import CommonSettings, TelemetrySettings
from services.common.telemetry import Telemetry
from services.common.deaths import admin_reader
from tests.stack import REPO

FAST_GROUP = {"OCRSTREAM_KAFKA__SESSION_TIMEOUT_MS": "6000", "OCRSTREAM_KAFKA__HEARTBEAT_INTERVAL_MS": "1000"}


async def _topics(s: CommonSettings, ns: str, partitions: int = 1) -> tuple[str, str, str, str]:
    topic, out, dlq, group = f"{ns}.in", f"{ns}.out", f"{ns}.dlq", f"{ns}-dying"
    await create_topics(s.kafka.model_copy(update={"partitions": partitions}), [topic, out, dlq])
    return topic, out, dlq, group


async def _send(s: CommonSettings, topic: str, values: list[bytes], partition: int = 0) -> None:
    producer = make_producer(s.kafka, "test-deaths")
    await producer.start()
    try:
        for v in values:
            await producer.send_and_wait(topic, v, partition=partition)
    finally:
        await producer.stop()


async def _values(s: CommonSettings, topic: str, want: int, bound_s: float = 20) -> list[bytes]:
    """Every value on ``topic`` (waits until at least ``want`` are there, ``bound_s`` at most)."""
    consumer = make_consumer(s.kafka, [], None, "test-deaths-read")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or {0}]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[bytes] = []
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            for recs in (await consumer.getmany(timeout_ms=300)).values():
                out += [r.value for r in recs]
            if len(out) >= want and all([await consumer.position(tp) >= (await consumer.end_offsets([tp]))[tp]
                                         for tp in tps]):
                break
        return out
    finally:
        await consumer.stop()


async def _committed(s: CommonSettings, group: str, tps: list[TopicPartition]):
    admin = make_admin(s.kafka, "test-deaths-offsets")
    await admin.start()
    try:
        return await admin.list_consumer_group_offsets(group, partitions=tps)
    finally:
        await admin.close()


def _start(env: dict, args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.dying_stage", *args], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)


async def _run_until_drained(s, group, topic, end: int, args, tmp_path, max_starts: int) -> list[int]:
    """Start the dying stage, restart it each time it dies, until ``group`` has committed ``end``
    on ``topic``'s partition 0. Returns the exit codes of the processes that died."""
    env = dict(os.environ, **FAST_GROUP, PYTHONUNBUFFERED="1")
    tp = TopicPartition(topic, 0)
    deaths: list[int] = []
    with open(tmp_path / "dying.log", "ab") as log:
        proc = _start(env, args, log)
        try:
            deadline = time.monotonic() + 180  # liveness bound: session timeouts after each death included
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    deaths.append(proc.returncode)
                    assert len(deaths) < max_starts, f"died {deaths}; log {tmp_path / 'dying.log'}"
                    proc = _start(env, args, log)
                got = (await _committed(s, group, [tp])).get(tp)
                if got is not None and got.offset == end:
                    return deaths
                await asyncio.sleep(0.3)
            raise AssertionError(f"{group} never committed {end}: {(tmp_path / 'dying.log').read_text()[-3000:]}")
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)


async def test_a_record_that_kills_its_stage_twice_goes_to_the_dlq_and_the_rest_complete(stack_env, tmp_path):
    s = CommonSettings()
    ns = f"{stack_env['OCRSTREAM_REDIS__KEY_PREFIX']}-{uuid.uuid4().hex[:6]}"
    topic, out, dlq, group = await _topics(s, ns)
    values = [b"a0", b"a1", b"kill:x", b"a3", b"a4", b"a5", b"a6", b"a7"]
    await _send(s, topic, values)

    died = await _run_until_drained(s, group, topic, len(values), [topic, group, out, dlq, str(tmp_path)],
                                    tmp_path, max_starts=3)

    assert died == [-signal.SIGKILL, -signal.SIGKILL]  # a batch of 4 with it, then it alone: then never again
    # every other record was handled (once: the first death came before the batch produced anything)
    assert sorted(await _values(s, out, 7)) == sorted(v for v in values if not v.startswith(b"kill"))
    [raw] = await _values(s, dlq, 1)
    ev = DlqEvent.model_validate_json(raw)
    assert (ev.stage, ev.topic, ev.partition, ev.offset) == ("dying", topic, 0, 2)
    assert ev.error_code is ErrorCode.STAGE_CRASH and ev.attempts == 2
    assert "in progress when the dying stage died 2 times" in ev.reason
    # lag 0, and nothing left marked or counted in the group's commit metadata
    tp = TopicPartition(topic, 0)
    got = (await _committed(s, group, [tp]))[tp]
    assert got.offset == len(values) and decode(got.metadata) == (None, {})


async def test_one_death_only_the_record_is_handled_normally_on_restart(stack_env, tmp_path):
    s = CommonSettings()
    ns = f"{stack_env['OCRSTREAM_REDIS__KEY_PREFIX']}-{uuid.uuid4().hex[:6]}"
    topic, out, dlq, group = await _topics(s, ns)
    values = [b"b0", b"kill-once:y", b"b2", b"b3", b"b4"]
    await _send(s, topic, values)

    died = await _run_until_drained(s, group, topic, len(values), [topic, group, out, dlq, str(tmp_path)],
                                    tmp_path, max_starts=2)

    assert died == [-signal.SIGKILL]
    assert sorted(await _values(s, out, 5)) == sorted(values)  # kill-once:y included: handled after 1 death
    assert await _values(s, dlq, 0, bound_s=2) == []


async def test_a_sigterm_that_drains_leaves_no_mark(stack_env, tmp_path):
    """SIGTERM mid-batch: the batch is finished and committed, the metadata holds no mark, and the
    next process counts no death (it handles the rest in batches, nothing goes to the DLQ)."""
    s = CommonSettings()
    ns = f"{stack_env['OCRSTREAM_REDIS__KEY_PREFIX']}-{uuid.uuid4().hex[:6]}"
    topic, out, dlq, group = await _topics(s, ns)
    values = [b"slow:3", b"c1", b"c2", b"c3", b"c4", b"c5"]
    await _send(s, topic, values)
    env = dict(os.environ, **FAST_GROUP, PYTHONUNBUFFERED="1")
    args = [topic, group, out, dlq, str(tmp_path)]
    tp = TopicPartition(topic, 0)
    with open(tmp_path / "dying.log", "ab") as log:
        proc = _start(env, args, log)
        try:
            deadline = time.monotonic() + 60
            while True:  # the first batch is marked in progress: the process holds it
                got = (await _committed(s, group, [tp])).get(tp)
                if got is not None and decode(got.metadata)[0] is not None:
                    break
                assert time.monotonic() < deadline, (tmp_path / "dying.log").read_text()[-3000:]
                await asyncio.sleep(0.1)
            assert decode(got.metadata)[0] == (0, 3) and got.offset == 0  # the batch of 4, position unchanged
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    got = (await _committed(s, group, [tp]))[tp]
    assert got.offset == 4 and decode(got.metadata) == (None, {})
    assert await _run_until_drained(s, group, topic, len(values), args, tmp_path, max_starts=1) == []
    assert sorted(await _values(s, out, 6)) == sorted(values)
    assert await _values(s, dlq, 0, bound_s=2) == []
    assert "one at a time" not in (tmp_path / "dying.log").read_text()


class Holding(Handler):
    """Holds its first batch until ``release`` is set; records what it handled."""

    def __init__(self):
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self.handled: list[tuple[int, int]] = []
        self.poisoned: list[tuple[int, int]] = []

    async def handle(self, records):
        if not self.holding.is_set():
            self.holding.set()
            await self.release.wait()
        self.handled += [(r.partition, r.offset) for r in records]
        return []

    def poison(self, record, exc, attempts):
        self.poisoned.append((record.partition, record.offset))
        return []


class LoggingRunner(StageRunner):
    """Records the deaths its ledger knows after each assignment."""

    loaded: list[dict]

    async def _assigned(self, assigned):
        await super()._assigned(assigned)
        self.loaded = [*getattr(self, "loaded", []), self.deaths.snapshot()]


async def test_a_rebalance_mid_batch_is_not_a_death(stack_env):
    """A second consumer joins while the first holds a marked batch: the revocation clears the
    mark (the first still owns its partitions during the callback), so neither counts a death,
    nothing is handled one at a time for it, nothing is poisoned, and every record is committed."""
    s = CommonSettings()
    ns = f"{stack_env['OCRSTREAM_REDIS__KEY_PREFIX']}-{uuid.uuid4().hex[:6]}"
    topic, _, _, group = await _topics(s, ns, partitions=2)
    for p in (0, 1):
        await _send(s, topic, [b"r%d" % i for i in range(6)], partition=p)
    tps = [TopicPartition(topic, 0), TopicPartition(topic, 1)]
    admin = make_admin(s.kafka, "test-deaths-rebalance")
    await admin.start()
    runners, consumers, tasks = [], [], []
    stop = asyncio.Event()

    async def join(handler: Handler) -> LoggingRunner:
        kafka = s.kafka.model_copy(update={"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000})
        consumer = make_consumer(kafka, [], group, f"test-rebalance-{len(runners)}")
        runner = LoggingRunner(stage="test", consumer=consumer, producer=None, handler=handler,  # type: ignore[arg-type]
                               telemetry=Telemetry("test", TelemetrySettings()), max_batch=4, max_wait_ms=100,
                               poison_after_deaths=1, read_committed=admin_reader(admin, group))
        consumer.subscribe([topic], listener=runner.listener)
        await consumer.start()
        runners.append(runner)
        consumers.append(consumer)
        tasks.append(asyncio.create_task(runner.run(stop)))
        return runner

    first_handler, second_handler = Holding(), Holding()
    second_handler.holding.set()
    second_handler.release.set()
    try:
        first = await join(first_handler)
        await asyncio.wait_for(first_handler.holding.wait(), 60)
        marked = {tp: decode(om.metadata)[0] for tp, om in (await _committed(s, group, tps)).items()}
        assert any(marked.values()), marked  # the batch it holds is marked in progress
        second = await join(second_handler)
        for _ in range(200):  # the revocation ran: the first consumer's marks are cleared
            committed = await _committed(s, group, tps)
            if all(decode(om.metadata)[0] is None for om in committed.values()) and len(first.loaded) >= 2:
                break
            await asyncio.sleep(0.1)
        first_handler.release.set()
        for _ in range(300):  # liveness bound: 30 s
            committed = await _committed(s, group, tps)
            if all(committed[tp].offset == 6 for tp in tps):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"not every record committed: {committed}")
    finally:
        stop.set()
        for t in tasks:
            await asyncio.wait_for(t, 30)
        for c in consumers:
            await c.stop()
        await admin.close()

    # poison_after_deaths=1: a single death counted anywhere would have sent a record to the DLQ
    assert first_handler.poisoned == second_handler.poisoned == []
    assert all(snap == {} for r in (first, second) for snap in r.loaded), (first.loaded, second.loaded)
    handled = set(first_handler.handled) | set(second_handler.handled)
    assert handled == {(p, i) for p in (0, 1) for i in range(6)}
    assert all(decode(committed[tp].metadata) == (None, {}) for tp in tps)
