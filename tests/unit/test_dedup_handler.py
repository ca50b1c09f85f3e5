"""Dedup's tiers and its reaper's decisions, with an in-memory cache and backlog (pure logic).

The same rules run against real Redis and Kafka in ``tests/integration/test_cache_leases.py`` and
``tests/integration/test_single_flight_failures.py``; here each branch is pinned on its own.
"""

from __future__ import annotations

import asyncio

import orjson
from aiokafka import ConsumerRecord

from schemas.events import RequestEvent
from services.common.cache import CacheEntry, CacheUnavailable, Claim, Promotion
from services.common.events import dumps
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from services.dedup.backlog import BacklogUnknown
from services.dedup.handler import DedupHandler
from services.dedup.settings import DedupSettings

S = DedupSettings()
SHA = "ab" * 32


class CountingCache:
    """Counts Redis calls; claims hit when ``entry`` is set; the reaper's view is scripted."""

    def __init__(self, entry: CacheEntry | None = None):
        self.entry = entry
        self.calls: list[str] = []
        self.expired: list[str] = []
        self.holders: dict[str, str] = {}  # key -> holder request id (lease held)
        self.waiters: dict[str, list[bytes]] = {}
        self.gaveup: dict[str, bytes] = {}  # request id -> RequestEvent JSON (<prefix>:gaveup)

    async def given_up(self, limit: int = 100) -> list[bytes]:
        self.calls.append("given_up")
        return list(self.gaveup.values())[:limit]

    async def forget_given_up(self, request_ids: list[str]) -> None:
        self.calls.append("forget_given_up")
        for rid in request_ids:
            self.gaveup.pop(rid, None)

    async def register_generation(self, gen) -> None:
        self.calls.append("register_generation")

    async def claim(self, key, request_id, waiter_json, lease_ms) -> Claim:
        self.calls.append("claim")
        return Claim("hit", self.entry, 30_000) if self.entry else Claim("lead")

    async def expired_leases(self, limit: int = 100) -> list[str]:
        self.calls.append("expired_leases")
        return list(self.expired)

    async def promote(self, key, lease_ms, expected_holder="", unheld_only=False, attempt=2):
        self.calls.append("promote_unheld" if unheld_only else "promote")
        if unheld_only and key in self.holders:
            return Promotion("held")
        w = self.waiters.get(key) or []
        if not w:
            return Promotion("none")
        return Promotion("promoted", w.pop(0), None, attempt)

    async def extend(self, key, lease_ms) -> bool:
        self.calls.append("extend")
        return True

    async def remove_waiters(self, key, waiters) -> None:
        self.calls.append(f"remove_waiters {len(waiters)}")
        self.waiters[key] = [w for w in self.waiters.get(key, []) if w not in waiters]


class ScriptedBacklog:
    """Every key maps to partition 0; ``ends``/``committed``: topic -> offset of partition 0, or
    ``error`` to raise. Change them between reaper passes to move Kafka on."""

    def __init__(self, ends=None, committed=None, error: Exception | None = None):
        self.ends = ends or {S.topics.infer: 0, S.topics.results: 0}
        self.committed = committed or {S.topics.infer: 0, S.topics.results: 0}
        self.error = error
        self.asked = 0

    async def offsets(self):
        self.asked += 1
        if self.error:
            raise self.error
        return {t: ({0: self.ends[t]}, {0: self.committed[t]}) for t in self.ends}

    def partition(self, topic: str, key: bytes) -> int:
        return 0

    async def close(self) -> None:
        pass


def handler(cache, backlog=None) -> DedupHandler:
    return DedupHandler(S, cache, Telemetry("dedup", TelemetrySettings()), backlog=backlog)


def request(rid: str) -> RequestEvent:
    return RequestEvent(request_id=rid, content_sha256=SHA, image_uri=f"s3://b/images/{SHA}", size_bytes=10)


def handle(h: DedupHandler, req: RequestEvent):
    rec = ConsumerRecord("ocr.requests", 0, 0, 0, 0, None, dumps(req), None, 0, 0, [])
    [out] = asyncio.run(h.handle([rec]))
    return out.topic, orjson.loads(out.value)


def test_a_repeat_within_the_lru_ttl_is_answered_without_any_redis_call():
    cache = CountingCache(CacheEntry("s3://b/results/x.json", 2, 10, 1))
    h = handler(cache)
    topic, ev = handle(h, request("first"))
    assert topic == S.topics.results and ev["cache_hit"] and ev["result_uri"] == "s3://b/results/x.json"
    assert cache.calls == ["register_generation", "claim"]
    topic, ev = handle(h, request("second"))
    assert topic == S.topics.results and ev["cache_hit"] and ev["request"]["request_id"] == "second"
    assert cache.calls == ["register_generation", "claim"]  # the LRU answered: Redis was not called
    assert h.telemetry.cache.labels("dedup", "hit", "lru")._value.get() == 1


def _held(cache: CountingCache, waiter: bytes) -> str:
    key = f"gen:{SHA}"
    cache.expired, cache.holders[key], cache.waiters[key] = [key], "holder", [waiter]
    return key


def test_a_queued_holder_is_extended_until_infer_and_then_the_sink_commit_past_their_marks():
    """Under steady traffic the partitions are never empty: the reaper waits for the groups to
    commit past the end offsets it noted, not for zero lag."""
    cache = CountingCache()
    key = _held(cache, dumps(request("w1")))
    backlog = ScriptedBacklog(ends={S.topics.infer: 100, S.topics.results: 50},
                              committed={S.topics.infer: 90, S.topics.results: 50})
    h = handler(cache, backlog)
    assert asyncio.run(h.on_idle()) == [] and cache.calls[-2:] == ["extend", "given_up"]  # mark: ocr.infer at 100
    backlog.ends[S.topics.infer] = 130  # new traffic keeps arriving...
    backlog.committed[S.topics.infer] = 120  # ...and infer commits past the mark: on to ocr.results at 70
    backlog.ends[S.topics.results] = 70
    assert asyncio.run(h.on_idle()) == [] and cache.calls[-2:] == ["extend", "given_up"]
    backlog.ends[S.topics.results] = 90
    backlog.committed[S.topics.results] = 69  # not yet past 70
    assert asyncio.run(h.on_idle()) == [] and cache.calls[-2:] == ["extend", "given_up"]
    backlog.committed[S.topics.results] = 80  # the sink handled the holder's result; the key is still held
    [msg] = asyncio.run(h.on_idle())
    assert orjson.loads(msg.value)["request"]["request_id"] == "w1" and orjson.loads(msg.value)["cache_key"] == key
    assert cache.calls[-2:] == ["promote", "given_up"] and h._marks == {}


def test_the_reaper_keeps_the_holder_when_kafka_cannot_tell():
    cache = CountingCache()
    _held(cache, dumps(request("w1")))
    out = asyncio.run(handler(cache, ScriptedBacklog(error=BacklogUnknown("kafka down"))).on_idle())
    assert out == [] and cache.calls == ["expired_leases", "promote_unheld", "extend", "given_up"]


def test_the_reaper_replaces_a_holder_that_is_not_queued_anywhere():
    cache = CountingCache()
    key = _held(cache, dumps(request("w1")))
    backlog = ScriptedBacklog(ends={S.topics.infer: 7, S.topics.results: 7}, committed={S.topics.infer: 7, S.topics.results: 7})
    [msg] = asyncio.run(handler(cache, backlog).on_idle())
    ev = orjson.loads(msg.value)
    assert msg.topic == S.topics.infer and ev["request"]["request_id"] == "w1" and ev["cache_key"] == key
    assert cache.calls == ["expired_leases", "promote_unheld", "promote", "given_up"]


def test_waiters_of_a_released_lease_are_promoted_without_asking_kafka():
    cache = CountingCache()
    key = f"gen:{SHA}"
    cache.expired, cache.waiters[key] = [key], [dumps(request("w1"))]  # nobody holds the lease
    backlog = ScriptedBacklog()
    [msg] = asyncio.run(handler(cache, backlog).on_idle())
    assert orjson.loads(msg.value)["request"]["request_id"] == "w1" and backlog.asked == 0


def test_the_reaper_does_nothing_while_redis_is_down():
    class Down(CountingCache):
        async def expired_leases(self, limit: int = 100):
            raise CacheUnavailable("down")

    assert asyncio.run(handler(Down(), ScriptedBacklog()).on_idle()) == []


def test_a_resent_holder_keeps_its_attempt_and_a_given_up_one_ends_with_an_error():
    """``resent`` goes to ocr.infer with the attempt kept with it; an ``abandoned`` waiter (sent
    PROMOTED_MAX_SENDS times without a result) gets an internal_error result with no cache key
    (so the sink completes that request alone), next to the promotion of the following waiter,
    and is forgotten in Redis only after that result is acknowledged."""
    key = f"gen:{SHA}"

    class Scripted(CountingCache):
        def __init__(self, *answers):
            super().__init__()
            self.answers = list(answers)
            self.expired = [key]

        async def promote(self, key, lease_ms, expected_holder="", unheld_only=False, attempt=2):
            p = self.answers.pop(0)
            if p.abandoned is not None:  # as the Lua script: kept until forgotten
                self.gaveup[orjson.loads(p.abandoned)["request_id"]] = p.abandoned
            return p

    cache = Scripted(Promotion("resent", dumps(request("w1")), None, 3))
    [msg] = asyncio.run(handler(cache).on_idle())
    ev = orjson.loads(msg.value)
    assert msg.topic == S.topics.infer and ev["request"]["request_id"] == "w1" and ev["attempt"] == 3
    cache = Scripted(Promotion("promoted", dumps(request("w2")), dumps(request("w1")), 2))
    h = handler(cache)
    promoted, gave_up = asyncio.run(h.on_idle())
    ev = orjson.loads(gave_up.value)
    assert gave_up.topic == S.topics.results and ev["request"]["request_id"] == "w1" and ev["cache_key"] is None
    assert ev["status"] == "error" and ev["error"] == {
        "code": "internal_error", "message": "sent to inference 3 times and no result came back"}
    assert promoted.topic == S.topics.infer and orjson.loads(promoted.value)["request"]["request_id"] == "w2"
    assert h.telemetry.cache.labels("dedup", "abandoned", "redis")._value.get() == 1
    assert set(cache.gaveup) == {"w1"}  # until Kafka has acknowledged the result
    asyncio.run(h.after_produce())
    assert cache.gaveup == {}


def test_a_given_up_waiter_whose_promotion_reply_was_lost_is_still_ended():
    """The promotion that gave a waiter up ran in Redis but its reply never came (a slow Redis, or
    the dedup that ran it died): the next reaper pass finds it in ``given_up`` and ends it; a
    failed forget leaves it there to be ended again, never lost."""
    cache = CountingCache()
    cache.gaveup["w1"] = dumps(request("w1"))
    h = handler(cache)
    [msg] = asyncio.run(h.on_idle())
    ev = orjson.loads(msg.value)
    assert msg.topic == S.topics.results and ev["request"]["request_id"] == "w1"
    assert ev["error"]["code"] == "internal_error"

    class Down(CountingCache):
        async def forget_given_up(self, request_ids):
            raise CacheUnavailable("down")

    down = Down()
    down.gaveup["w1"] = dumps(request("w1"))
    h = handler(down)
    assert len(asyncio.run(h.on_idle())) == 1
    asyncio.run(h.after_produce())  # logged, not raised
    assert len(asyncio.run(h.on_idle())) == 1  # ended again
    asyncio.run(h.after_produce())
    asyncio.run(handler(cache).after_produce())  # nothing to forget: no call
    assert cache.calls.count("forget_given_up") == 0


def test_waiters_left_on_a_cached_key_are_answered_from_the_entry_then_removed():
    """The reaper finds a key due whose result is cached but whose waiters were never completed
    (the sink deferred them while Redis was down and died, or is stuck in a long MariaDB outage):
    each waiter gets a cache hit with the entry's result URI, and they are removed from Redis
    only after those results are acknowledged; a failed pass removes nothing."""
    key = f"gen:{SHA}"
    entry = CacheEntry("s3://b/results/ab/gen.json", 2, 20, 1)

    class Cached(CountingCache):
        async def promote(self, key, lease_ms, expected_holder="", unheld_only=False, attempt=2):
            self.calls.append("promote")
            return Promotion("hit", entry.to_json(), None, attempt, tuple(self.waiters.get(key, [])))

    cache = Cached()
    cache.expired = [key]
    cache.waiters[key] = [dumps(request("w1")), dumps(request("w2"))]
    h = handler(cache)
    out = asyncio.run(h.on_idle())
    evs = [orjson.loads(m.value) for m in out]
    assert [m.topic for m in out] == [S.topics.results] * 2
    assert [e["request"]["request_id"] for e in evs] == ["w1", "w2"]
    assert all(e["status"] == "ok" and e["cache_hit"] and e["result_uri"] == entry.result_uri and e["cache_key"] == key
               for e in evs)
    assert len(cache.waiters[key]) == 2  # not before Kafka has them
    asyncio.run(h.after_produce())
    assert cache.waiters[key] == [] and "remove_waiters 2" in cache.calls
    assert h.telemetry.cache.labels("dedup", "waiters_answered", "redis")._value.get() == 2

    class Broken(Cached):
        async def given_up(self, limit=100):
            raise RuntimeError("a bug after the answers were built")

    broken = Broken()
    broken.expired = [key]
    broken.waiters[key] = [dumps(request("w1"))]
    h = handler(broken)
    try:
        asyncio.run(h.on_idle())
        raise AssertionError("on_idle should have raised")
    except RuntimeError:
        pass
    asyncio.run(h.after_produce())  # as after the next batch: nothing of the failed pass is removed
    assert len(broken.waiters[key]) == 1 and not any(c.startswith("remove_waiters") for c in broken.calls)
