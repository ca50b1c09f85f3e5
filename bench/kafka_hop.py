"""The floor of one Kafka hop on the local broker: produce -> acknowledged -> consumed, in ms.

A repeat served from the cache crosses four topics (``ocr.submit``, ``ocr.requests``,
``ocr.results``, ``ocr.completed``), so four of these hops bound its submit -> completion latency
from below, whatever the stages do. This script measures one hop with the project's own producer
and consumer settings (:func:`~services.common.kafka.make_producer`, ``acks=all``, idempotent,
``linger_ms=0``) on a topic of its own, in one run, two ways:

- *paced*: one record every ``--gap-ms`` (default 100 ms, the pipeline's 10 requests/s): the
  broker's threads and this process are idle between records, as in ``bench/cache_bench.py``;
- *back to back*: the next record is produced as soon as the previous one is acknowledged.

and prints, for each, the p50/p99 of the acknowledgement and of the record's age when the
consumer receives it (now - its create timestamp), the ratio paced / back to back, and the p50 of
an offset commit (the group coordinator's ``group.coordinator.append.linger.ms`` is in it).

Usage: python -m bench.kafka_hop [--n 300] [--gap-ms 100]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
import uuid

from bench.common import pct
from services.common.kafka import create_topics, make_consumer, make_producer
from services.common.settings import CommonSettings


async def _hops(n: int, gap_s: float) -> tuple[list[float], list[float], list[float]]:
    """``n`` records through a fresh topic: (ack ms, received age ms) per record, and commit ms."""
    cfg = CommonSettings().kafka.model_copy(update={"partitions": 1})
    topic = f"bench-hop-{uuid.uuid4().hex[:8]}"
    await create_topics(cfg, [topic])
    producer = make_producer(cfg, "bench-hop")
    consumer = make_consumer(cfg, [topic], f"{topic}-g", "bench-hop")
    await producer.start()
    await consumer.start()
    acks: list[float] = []
    ages: list[float] = []
    got = asyncio.Event()
    try:
        await producer.send_and_wait(topic, b"warm-up")  # metadata, the group join and the first fetch
        while not await consumer.getmany(timeout_ms=1000):
            pass

        async def consume() -> None:
            while True:
                for recs in (await consumer.getmany(timeout_ms=1000)).values():
                    for r in recs:
                        ages.append(time.time() * 1000 - r.timestamp)
                        got.set()

        task = asyncio.create_task(consume())
        for i in range(n):
            got.clear()
            t0 = time.perf_counter()
            await producer.send_and_wait(topic, b"x" * 200, key=str(i).encode())
            acks.append((time.perf_counter() - t0) * 1000)
            await asyncio.wait_for(got.wait(), 10)
            if gap_s:
                await asyncio.sleep(gap_s)
        task.cancel()
        commits = []
        for _ in range(20):
            t0 = time.perf_counter()
            await consumer.commit()
            commits.append((time.perf_counter() - t0) * 1000)
            if gap_s:
                await asyncio.sleep(gap_s)
        return acks, ages, commits
    finally:
        await consumer.stop()
        await producer.stop()


def main() -> None:
    """Run both settings and print their latencies and the paced / back-to-back ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="records per setting")
    ap.add_argument("--gap-ms", type=float, default=100.0, help="pause between records in the paced setting, ms")
    a = ap.parse_args()
    print(f"machine: {platform.machine()}, {__import__('os').cpu_count()} cores; {a.n} records per setting")
    res = {}
    for label, gap in (("paced", a.gap_ms / 1000), ("back to back", 0.0)):
        acks, ages, commits = asyncio.run(_hops(a.n, gap))
        res[label] = statistics.median(ages)
        print(f"[{label:12}] ack p50 {pct(acks, 50):6.2f} p99 {pct(acks, 99):6.2f} ms | received age p50 "
              f"{pct(ages, 50):6.2f} p99 {pct(ages, 99):6.2f} ms | commit p50 {statistics.median(commits):6.2f} ms")
    print(f"one hop, paced / back to back (received age p50): {res['paced'] / res['back to back']:.2f}x; "
          f"four paced hops: {4 * res['paced']:.1f} ms")


if __name__ == "__main__":
    main()
