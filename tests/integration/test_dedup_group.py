"""Dedup's consumer group on the real broker: members joining and leaving mid-run.

Dedup reads one topic, ``ocr.requests``, whose records are a cache key's requests and its
settlement (from the sink) in one log per key (its content SHA-256's partition), so the group needs
no assignor of its own: whoever owns partition p reads every record of p's keys in order, and
restores p's keyed state from the changelog's partition p. The real stages with 4 partitions, a
second dedup joining mid-run and the first leaving: every request completes once with its own
image's text, each unique image is computed once, and keys in flight with waiting copies moved
between the processes through the changelog.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

from aiokafka import TopicPartition

from schemas.events import CompletedEvent
from services.common.kafka import make_consumer
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.fault.conftest import db_count
from tests.stack import Pipeline, Stage, namespaced_pipeline

PARTITIONS = 4


# -- pipeline level -------------------------------------------------------------------------------
ASSIGNED = re.compile(r"dedup: assigned (\[.*\])")
RESTORED = re.compile(r"dedup: restored partitions (\[[\d, ]*\]) from the changelog in \d+ ms: (\d+) keys in flight, "
                      r"(\d+) waiting copies, (\d+) settled keys")


def waves() -> list[list[tuple[bytes, str]]]:
    """300 requests over 30 images in three waves of 100: each wave brings 10 new images (10 copies
    each in the first, 6 in the others) and copies of the earlier ones, interleaved, so keys are
    in flight in dedup's state when the group rebalances."""
    images = [(text_image([f"INVOICE {2000 + i}"]), f"INVOICE {2000 + i}") for i in range(30)]
    plan = [[(images[i], 10) for i in range(10)],
            [(images[i], 6) for i in range(10, 20)] + [(images[i], 4) for i in range(10)],
            [(images[i], 6) for i in range(20, 30)] + [(images[i], 2) for i in range(20)]]
    out = []
    for wave in plan:
        items, left = [], [[img, n] for img, n in wave]
        while left:  # one copy of each image in turn
            for entry in left:
                items.append(entry[0])
                entry[1] -= 1
            left = [e for e in left if e[1] > 0]
        out.append(items)
    return out


def logged(st: Stage, since: int, pattern: re.Pattern) -> list[re.Match]:
    """Matches of ``pattern`` in ``st``'s log from byte ``since`` on."""
    return list(pattern.finditer(st.log.read_bytes()[since:].decode(errors="replace")))


async def until_logged(st: Stage, since: int, pattern: re.Pattern, count: int = 1, bound_s: float = 120) -> None:
    deadline = time.monotonic() + bound_s
    while len(logged(st, since, pattern)) < count:
        assert time.monotonic() < deadline, f"no {pattern.pattern!r} in {st.log} after {bound_s}s"
        await asyncio.sleep(0.2)


def assignments(st: Stage) -> list[dict[str, set[int]]]:
    """Every assignment ``st`` logged: topic -> partition numbers."""
    out = []
    for m in logged(st, 0, ASSIGNED):
        got: dict[str, set[int]] = {}
        for topic, p in re.findall(r"TopicPartition\(topic='([^']+)', partition=(\d+)\)", m.group(1)):
            got.setdefault(topic, set()).add(int(p))
        out.append(got)
    return out


async def completions(s: CommonSettings, ids: set[str]) -> dict[str, set[bytes]]:
    """The distinct ``ocr.completed`` values of each of ``ids`` (replays are byte-identical)."""
    consumer = make_consumer(s.kafka, [], None, "test-copart-completed")
    await consumer.start()
    try:
        tps = [TopicPartition(s.topics.completed, n) for n in consumer.partitions_for_topic(s.topics.completed) or ()]
        assert tps
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        out: dict[str, set[bytes]] = {}
        while any([await consumer.position(tp) < end[tp] for tp in tps]):
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                for r in recs:
                    ev = CompletedEvent.model_validate_json(r.value)
                    if ev.request_id in ids:
                        out.setdefault(ev.request_id, set()).add(r.value)
        return out
    finally:
        await consumer.stop()


async def test_dedup_joining_and_leaving_mid_run_completes_every_request_once(tmp_path: Path):
    """300 requests over 30 images in three waves; a second dedup joins during the second wave, the
    first leaves (SIGTERM) during the third. Every request ends once (one row, one distinct
    completion) with its own image's text, the engine reads each image once, every assignment a
    dedup process logged is of ocr.requests alone, and the second process restored keys in flight
    with waiting copies from the changelog both times."""
    extra = {"OCRSTREAM_KAFKA__SESSION_TIMEOUT_MS": "10000", "OCRSTREAM_KAFKA__HEARTBEAT_INTERVAL_MS": "1000",
             "OCRSTREAM_SHUTDOWN_TIMEOUT_S": "15"}
    logdir = tmp_path / "logs"
    with namespaced_pipeline(logdir, extra, partitions=PARTITIONS) as p:
        await _join_and_leave(p)


async def _join_and_leave(p: Pipeline) -> None:
    """The test's body, in ``p`` (one process per stage at the start)."""
    s = CommonSettings()
    one, two, three = waves()
    [first] = p.stages["dedup"]
    calls = p.engine_calls()
    runs = [asyncio.create_task(p.run(one, timeout=600))]
    await until_logged(first, 0, re.compile(r"-> ocr\.infer \(holder\)"))  # mid-run: keys in flight
    at_join = first.log.stat().st_size
    joining = asyncio.create_task(asyncio.to_thread(p.start, "dedup"))
    await asyncio.sleep(1.0)
    runs.append(asyncio.create_task(p.run(two, timeout=600)))
    second = await joining
    await until_logged(first, at_join, re.compile(r"dedup: partitions .* revoked"))
    await until_logged(first, at_join, ASSIGNED)
    await until_logged(second, 0, ASSIGNED)
    at_three = first.log.stat().st_size
    runs.append(asyncio.create_task(p.run(three, timeout=600)))
    # the first leaves once a copy has joined a key in flight on its partitions (of the second wave
    # or the third), not after a fixed sleep: on a loaded machine the third wave may not be there yet
    await until_logged(first, at_three, re.compile(r"joined the copy in flight"))
    at_leave = second.log.stat().st_size
    assert await asyncio.to_thread(p.stop, first, signal.SIGTERM, 60) == 0  # leaves mid-run
    await until_logged(second, at_leave, ASSIGNED)
    docs = [d for run in runs for d in await run]
    items = [*one, *two, *three]

    # every request completed once, with its own image's text
    assert len(docs) == 300 and len({d.request_id for d in docs}) == 300
    for (_, name), doc in zip(items, docs):
        assert doc.status == "ok", (name, doc.error)
        assert doc.text == name, (name, doc.text)
    ids = [d.request_id for d in docs]
    assert db_count(ids) == dict.fromkeys(ids, 1)
    done = await completions(s, set(ids))
    assert set(done) == set(ids)
    assert not {i: len(v) for i, v in done.items() if len(v) != 1}, "requests with more than one distinct completion"
    # each unique image computed once, though its key's state moved between processes twice
    revocations = logged(first, 0, re.compile(r"dedup: partitions .* revoked.*"))
    restores = [m.group(0) for st in (first, second) for m in logged(st, 0, RESTORED)]
    slow = [m.group(0) for st in (first, second) for m in logged(st, 0, re.compile(r".*did not finish within.*"))]
    assert p.engine_calls() - calls == 30, (f"engine calls {p.engine_calls() - calls}; revocations "
                                           f"{[m.group(0) for m in revocations]}; restores {restores}; drain "
                                           f"timeouts {slow}; logs in {p.logdir}")
    assert not slow

    # every assignment either process had is of ocr.requests alone; while both ran they shared its
    # partitions, two each, and the one left at the end had all four
    req = s.topics.requests
    for st in (first, second):
        for got in assignments(st):
            assert set(got) == {req}, (st.log, got)
    [initial, *_, shared] = assignments(first)
    assert initial == {req: {0, 1, 2, 3}}
    assert assignments(second)[-1] == {req: {0, 1, 2, 3}}  # the first left
    halves = [shared[req], assignments(second)[0][req]]
    assert sorted(map(len, halves)) == [2, 2] and halves[0] | halves[1] == {0, 1, 2, 3}, halves
    # the scenario this test names: state in flight moved to the second process, at the join and when
    # the first left (its restores found keys in flight and copies waiting on them in the changelog)
    moved = [(int(m.group(2)), int(m.group(3))) for m in logged(second, 0, RESTORED)]
    assert len(moved) >= 2 and all(keys > 0 and waiting > 0 for keys, waiting in (moved[0], moved[-1])), restores
