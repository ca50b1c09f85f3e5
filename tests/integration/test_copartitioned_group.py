"""Dedup's co-partitioned consumer group on the real broker (issue #22).

Dedup reads ``ocr.requests`` and ``ocr.settled`` in one group; a request and its key's settlement
land on the same partition number, so partition p of both topics must belong to one member at all
times (:class:`services.common.assignor.CopartitionedAssignor`). What a member owns is read back from
the broker (DescribeGroups: the assignment the group leader computed, as the broker hands it out)
and from each consumer's own ``assignment()``.

* consumer level: plain aiokafka consumers in one group, one member, then a second and a third
  joining, then one leaving; the same setup with aiokafka's default assignor (round robin) splits
  partition p of the two topics between members, so a regression to the default is caught;
* pipeline level: the real stages with 4 partitions, a second dedup joining mid-run and the first
  leaving: every assignment a dedup process logs is co-partitioned, every request completes once
  with its own image's text, and each unique image is computed once.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment

from schemas.events import CompletedEvent
from services.common.assignor import CopartitionedAssignor
from services.common.kafka import create_topics, make_admin, make_consumer
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.fault.conftest import db_count
from tests.stack import Pipeline, Stage, namespaced_pipeline

PARTITIONS = 4
FAST_GROUP = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}

Plan = dict[str, dict[str, set[int]]]
"""Client id -> topic -> partition numbers it owns."""


# -- consumer level -------------------------------------------------------------------------------
class Group:
    """Consumers of one group over ``topics``, each with client id ``m<i>`` and a task polling it."""

    def __init__(self, s: CommonSettings, group: str, topics: list[str], assignors: tuple):
        self.kafka = s.kafka.model_copy(update=FAST_GROUP)
        self.group, self.topics, self.assignors = group, topics, assignors
        self.members: dict[str, tuple[AIOKafkaConsumer, asyncio.Task]] = {}
        self.joined = 0

    async def join(self) -> str:
        name = f"m{self.joined}"
        self.joined += 1
        consumer = make_consumer(self.kafka, self.topics, self.group, name, assignors=self.assignors)
        await consumer.start()

        async def poll():  # the topics stay empty; polling keeps the member live in the group
            while True:
                await consumer.getmany(timeout_ms=200)

        self.members[name] = (consumer, asyncio.create_task(poll()))
        return name

    async def leave(self, name: str) -> None:
        consumer, task = self.members.pop(name)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await consumer.stop()  # LeaveGroup: the others rebalance at once

    async def close(self) -> None:
        for name in list(self.members):
            await self.leave(name)

    def local(self) -> Plan:
        """What each consumer has been assigned, as it sees it."""
        out: Plan = {}
        for name, (consumer, _) in self.members.items():
            for tp in consumer.assignment():
                out.setdefault(name, {}).setdefault(tp.topic, set()).add(tp.partition)
        return out


async def broker_view(admin, group: str) -> tuple[str, str, Plan]:
    """The group's state, protocol (assignor name) and each member's assignment, from DescribeGroups."""
    [resp] = await admin.describe_consumer_groups([group])
    [g] = resp.to_object()["groups"]
    plan: Plan = {}
    for m in g["members"]:
        got = ConsumerProtocolMemberAssignment.decode(m["member_assignment"]) if m["member_assignment"] else None
        plan[m["client_id"]] = {t: set(ps) for t, ps in (got.assignment if got else []) if ps}
    return g["state"], g["protocol"], plan


async def settled_plan(admin, g: Group, timeout: float = 60) -> tuple[str, Plan]:
    """Wait until the broker's group is Stable with exactly ``g``'s live members, every partition of
    every topic assigned once, and each consumer holding what the broker says it holds; returns the
    protocol and that plan."""
    want = {TopicPartition(t, p) for t in g.topics for p in range(PARTITIONS)}
    deadline = time.monotonic() + timeout
    while True:
        state, protocol, plan = await broker_view(admin, g.group)
        owned = [TopicPartition(t, p) for per in plan.values() for t, ps in per.items() for p in ps]
        if (state == "Stable" and set(plan) == set(g.members) and sorted(owned) == sorted(want)
                and g.local() == {m: per for m, per in plan.items() if per}):
            return protocol, plan
        assert time.monotonic() < deadline, f"group {g.group} never settled: {state} {plan} local {g.local()}"
        await asyncio.sleep(0.2)


def split_partitions(plan: Plan, topics: list[str]) -> dict[int, dict[str, str]]:
    """Partition numbers whose topics are owned by different members: p -> topic -> owner."""
    owner = {(t, p): m for m, per in plan.items() for t, ps in per.items() for p in ps}
    out = {}
    for p in range(PARTITIONS):
        owners = {t: owner.get((t, p)) for t in topics}
        if len(set(owners.values())) != 1:
            out[p] = owners
    return out


async def _topics(s: CommonSettings) -> list[str]:
    ns = f"t{uuid.uuid4().hex[:8]}-copart"  # a fresh namespace: topics of this test alone
    topics = [f"{ns}.requests", f"{ns}.settled"]
    await create_topics(s.kafka.model_copy(update={"partitions": PARTITIONS}), topics)
    return topics


async def test_copartitioned_assignor_keeps_partition_p_of_both_topics_on_one_member():
    s = CommonSettings()
    topics = await _topics(s)
    req, st = topics
    admin = make_admin(s.kafka, "test-copart")
    await admin.start()
    g = Group(s, f"{req}-group", topics, (CopartitionedAssignor,))
    seen: list[Plan] = []

    async def check(expected: dict[str, set[int]]) -> None:
        protocol, plan = await settled_plan(admin, g)
        assert protocol == CopartitionedAssignor.name
        assert split_partitions(plan, topics) == {}, plan
        # member ids are the client id and a suffix, so the members sort as m0 < m1 < m2: each
        # takes a contiguous range of partition numbers, of both topics
        assert plan == {m: {req: ps, st: ps} if ps else {} for m, ps in expected.items()}, plan
        seen.append(plan)

    try:
        await g.join()
        await check({"m0": {0, 1, 2, 3}})
        await g.join()
        await check({"m0": {0, 1}, "m1": {2, 3}})
        await g.join()
        await check({"m0": {0, 1}, "m1": {2}, "m2": {3}})
        await g.leave("m0")  # the first member (the group leader) leaves: a new leader assigns
        await check({"m1": {0, 1}, "m2": {2, 3}})
    finally:
        await g.close()
        await admin.close()
    assert len(seen) == 4


async def test_default_round_robin_assignor_splits_partition_p_between_members():
    """The setup above with aiokafka's default: with three members round robin deals out
    ``req-0 .. req-3, set-0 .. set-3`` in turn, so partition p of the two topics lands on different
    members (with two it happens to pair them: 8 partitions dealt to 2 members alternate evenly)."""
    s = CommonSettings()
    topics = await _topics(s)
    admin = make_admin(s.kafka, "test-copart-rr")
    await admin.start()
    g = Group(s, f"{topics[0]}-rr", topics, (RoundRobinPartitionAssignor,))
    try:
        for _ in range(3):
            await g.join()
        protocol, plan = await settled_plan(admin, g)
    finally:
        await g.close()
        await admin.close()
    assert protocol == "roundrobin"
    # m0 gets req-0, req-3, set-2; m1 req-1, set-0, set-3; m2 req-2, set-1: every number split
    assert set(split_partitions(plan, topics)) == set(range(PARTITIONS)), plan


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
    dedup process logged holds partition p of both topics, and the second process restored keys in
    flight with waiting copies from the changelog both times."""
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
    runs.append(asyncio.create_task(p.run(three, timeout=600)))
    await asyncio.sleep(1.0)
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

    # partition p of both topics on one member in every assignment either process had
    req, settled = s.topics.requests, s.topics.settled
    for st in (first, second):
        for got in assignments(st):
            assert set(got) <= {req, settled} and got.get(req) == got.get(settled), (st.log, got)
    [initial, *_, shared] = assignments(first)
    assert initial == {req: {0, 1, 2, 3}, settled: {0, 1, 2, 3}}
    assert assignments(second)[-1] == {req: {0, 1, 2, 3}, settled: {0, 1, 2, 3}}  # the first left
    # while both ran, each had one contiguous half (which half: the order of their member ids)
    halves = [shared[req], assignments(second)[0][req]]
    assert sorted(map(sorted, halves)) == [[0, 1], [2, 3]], halves
    # the scenario this test names: state in flight moved to the second process, at the join and when
    # the first left (its restores found keys in flight and copies waiting on them in the changelog)
    moved = [(int(m.group(2)), int(m.group(3))) for m in logged(second, 0, RESTORED)]
    assert len(moved) >= 2 and all(keys > 0 and waiting > 0 for keys, waiting in (moved[0], moved[-1])), restores
