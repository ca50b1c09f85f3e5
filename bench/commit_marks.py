"""Cost of the in-progress marks (``OCRSTREAM_POISON_AFTER_DEATHS``): commits per batch and ms.

Against the local broker (deploy/local/up.sh must have run), on topics of its own:

1. one offset commit of 2 partitions, plain and with commit metadata (the marks' JSON, and
   1 KB of it), ``--commits`` times each: median and p95 ms;
2. the real runner (:class:`~services.common.runner.StageRunner`) with a no-op handler, deaths
   off (``poison_after_deaths=0``) and on (2), rounds alternating: lone records produced one at a
   time (each a batch of its own: the case where the mark costs most), time from the produce's
   acknowledgement to the handler seeing it, and commits per batch (counted on the consumer).

Usage: python -m bench.commit_marks [--commits 200] [--records 100] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from bench.common import pct
from services.common.deaths import admin_reader, encode
from services.common.kafka import create_topics, make_admin, make_consumer, make_producer
from services.common.runner import Handler, StageRunner
from services.common.settings import CommonSettings, TelemetrySettings
from services.common.telemetry import Telemetry


async def commit_latency(s: CommonSettings, n: int) -> None:
    ns = f"bench-marks-{uuid.uuid4().hex[:6]}"
    topic = f"{ns}.t"
    await create_topics(s.kafka.model_copy(update={"partitions": 2}), [topic])
    consumer = make_consumer(s.kafka, [topic], f"{ns}-g", "bench-marks")
    await consumer.start()
    try:
        while not consumer.assignment():
            await consumer.getmany(timeout_ms=200)
        tps = sorted(consumer.assignment())
        marks = encode((100, 163), dict.fromkeys(range(100, 164), 1))
        for label, meta in (("plain", None), ("marks", marks), ("1 KB", "x" * 1024)):
            ms = []
            for _ in range(n):
                t = time.perf_counter()
                await consumer.commit({tp: OffsetAndMetadata(0, meta) if meta else 0 for tp in tps})
                ms.append((time.perf_counter() - t) * 1000)
            print(f"commit of 2 partitions, metadata {label:5}: median {statistics.median(ms):.2f} ms, "
                  f"p95 {pct(ms, 95):.2f} ms ({n} commits)")
    finally:
        await consumer.stop()


class Timed(Handler):
    def __init__(self):
        self.seen: dict[bytes, float] = {}

    async def handle(self, records):
        now = time.perf_counter()
        for r in records:
            self.seen[r.value] = now
        return []

    def poison(self, record, exc, attempts):
        return []


class CountingConsumer:
    """Counts ``commit`` calls of the consumer it wraps."""

    def __init__(self, inner):
        self._inner, self.commits = inner, 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def commit(self, offsets=None):
        self.commits += 1
        return await self._inner.commit(offsets)


async def lone_records(s: CommonSettings, deaths: int, n: int) -> tuple[list[float], float]:
    ns = f"bench-marks-{uuid.uuid4().hex[:6]}"
    topic, group = f"{ns}.lone", f"{ns}-lone"
    await create_topics(s.kafka.model_copy(update={"partitions": 1}), [topic])
    admin = make_admin(s.kafka, "bench-marks")
    await admin.start()
    inner = make_consumer(s.kafka, [], group, "bench-marks")
    consumer = CountingConsumer(inner)
    handler = Timed()
    runner = StageRunner(stage="bench", consumer=consumer, producer=None, handler=handler,  # type: ignore[arg-type]
                         telemetry=Telemetry("bench", TelemetrySettings()), max_batch=64, max_wait_ms=0,
                         poison_after_deaths=deaths, read_committed=admin_reader(admin, group) if deaths else None)
    inner.subscribe([topic], listener=runner.listener)
    await inner.start()
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    producer = make_producer(s.kafka, "bench-marks")
    await producer.start()
    lat: list[float] = []
    try:
        await producer.send_and_wait(topic, b"warm-up")
        while b"warm-up" not in handler.seen:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        consumer.commits = 0
        for i in range(n):
            value = b"%d" % i
            await producer.send_and_wait(topic, value)
            sent = time.perf_counter()
            while value not in handler.seen:
                await asyncio.sleep(0.0005)
            lat.append((handler.seen[value] - sent) * 1000)
            await asyncio.sleep(0.03)  # the batch's commit is done: the next record is a batch of its own
        per_batch = consumer.commits / n
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await producer.stop()
        await inner.stop()
        await admin.close()
    return lat, per_batch


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commits", type=int, default=200)
    ap.add_argument("--records", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    s = CommonSettings()
    await commit_latency(s, args.commits)
    results: dict[int, list[float]] = {0: [], 2: []}
    for r in range(args.rounds):
        for deaths in (0, 2):
            lat, per_batch = await lone_records(s, deaths, args.records)
            results[deaths] += lat
            print(f"round {r}: deaths {'on ' if deaths else 'off'}: produce acked -> handled p50 "
                  f"{statistics.median(lat):.2f} ms, p95 {pct(lat, 95):.2f} ms; {per_batch:.2f} commits per batch")
    off, on = statistics.median(results[0]), statistics.median(results[2])
    print(f"lone records, all rounds: p50 off {off:.2f} ms, on {on:.2f} ms: the mark adds {on - off:.2f} ms per batch")


if __name__ == "__main__":
    asyncio.run(main())
