"""Leases in the real Redis: a lease left behind by a holder whose release failed is cleaned up."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from services.common.cache import PROMOTED_MAX_SENDS, CacheEntry, CacheUnavailable, Promotion, ResultCache
from services.common.settings import RedisSettings


def test_reaper_drops_a_stale_lease_once_the_result_is_cached(stack_env):
    """The holder stored the entry (complete_begin) but its release (complete_end) never ran,
    e.g. Redis blipped, or its sink died with the waiters deferred: the expired lease goes at the
    reaper's first look, and the waiters still listed come back with the entry, to be answered
    from it and then removed; until then the key is due again only a lease period on (not met
    on every pass: ``expired_leases`` reads 100 at a time), after that it leaves the in-flight set."""

    async def go():
        cache = ResultCache(RedisSettings(key_prefix=f"lease-test-{os.getpid()}-{time.time_ns()}"))
        key = "k" * 64
        entry_key, lease_key, waiters_key, inflight_key = cache._keys(key)
        try:
            assert (await cache.claim(key, "holder", b'{"request_id": "holder"}', lease_ms=50)).outcome == "lead"
            assert (await cache.claim(key, "copy", b'{"request_id": "copy"}', lease_ms=50)).outcome == "wait"
            waiters = await cache.complete_begin(key, CacheEntry("s3://b/results/x.json", 2, 10, 1), ttl_s=60)
            assert waiters == [b'{"request_id": "copy"}']
            await asyncio.sleep(0.1)  # the lease's deadline passes; complete_end never ran
            assert await cache.expired_leases() == [key]

            p = await cache.promote(key, lease_ms=600_000)
            assert p.outcome == "hit" and b"results/x.json" in p.raw and p.waiters == (b'{"request_id": "copy"}',)
            assert await cache.expired_leases() == []
            assert await cache.client.exists(lease_key) == 0
            assert await cache.client.zscore(inflight_key, key) > time.time() * 1000 + 590_000
            # a second reaper that listed the key too must not answer (and trim) the same waiters
            assert (await cache.promote(key, lease_ms=600_000, unheld_only=True)).outcome == "busy"
            # the waiter stays until whoever answers it removes it; a new request is a plain hit
            assert await cache.client.lrange(waiters_key, 0, -1) == [b'{"request_id": "copy"}']
            assert await cache.client.pttl(waiters_key) == -1
            assert (await cache.claim(key, "later", b'{"request_id": "later"}', lease_ms=50)).outcome == "hit"
            # removed by content: a second removal of the same waiters (two reapers that both
            # answered them) takes nothing else
            await cache.client.rpush(waiters_key, b'{"request_id": "other"}')
            await cache.remove_waiters(key, list(p.waiters))
            await cache.remove_waiters(key, list(p.waiters))
            assert await cache.client.lrange(waiters_key, 0, -1) == [b'{"request_id": "other"}']
            assert await cache.client.zscore(inflight_key, key) <= time.time() * 1000  # due at once for the rest
            await cache.client.delete(waiters_key)
            await cache.remove_waiters(key, [])
            assert await cache.client.zscore(inflight_key, key) is None
            # nobody left waiting: the in-flight mark goes at once
            await cache.client.zadd(inflight_key, {key: 0})
            p = await cache.promote(key, lease_ms=600_000)
            assert p.outcome == "hit" and p.waiters == () and await cache.client.zscore(inflight_key, key) is None
        finally:
            await cache.client.delete(entry_key, lease_key, waiters_key, inflight_key)
            await cache.close()

    asyncio.run(go())


def test_a_hit_carries_the_entrys_remaining_ttl(stack_env):
    """claim() reads the entry's PTTL with it, so dedup's LRU never keeps it longer than Redis."""

    async def go():
        cache = ResultCache(RedisSettings(key_prefix=f"ttl-test-{os.getpid()}-{time.time_ns()}"))
        key = "t" * 64
        try:
            assert (await cache.claim(key, "holder", b'{"request_id": "holder"}', lease_ms=60_000)).outcome == "lead"
            await cache.complete_begin(key, CacheEntry("s3://b/results/t.json", 1, 5, 1), ttl_s=600)
            await cache.complete_end(key, 0)
            hit = await cache.claim(key, "later", b'{"request_id": "later"}', lease_ms=60_000)
            assert hit.outcome == "hit" and hit.entry.result_uri == "s3://b/results/t.json"
            assert 590_000 < hit.ttl_ms <= 600_000
            await cache.client.persist(cache._keys(key)[0])  # an entry without expiry: no TTL to honour
            assert (await cache.claim(key, "x", b'{"request_id": "x"}', lease_ms=60_000)).ttl_ms is None
        finally:
            await cache.client.delete(*cache._keys(key))
            await cache.close()

    asyncio.run(go())


def test_local_redis_is_durable_enough_for_single_flight(stack_env):
    """deploy/local/up.sh starts Redis with AOF (fsync every second) and noeviction; the check
    ``ocrstream init`` runs reads them from the real server."""

    async def go():
        cache = ResultCache(RedisSettings())
        try:
            assert await cache.durability() == []
        finally:
            await cache.close()

    asyncio.run(go())


def test_an_uncached_result_hands_over_waiters_only_when_the_lease_is_its_holders(stack_env):
    """An error (or another generation's output) stores nothing, so a newer request may hold the
    key by the time a late or replayed result reaches the sink: its waiters and lease are left to
    that holder. The holder's own result, or one whose lease has lapsed, takes the waiters."""

    async def go():
        cache = ResultCache(RedisSettings(key_prefix=f"holder-test-{os.getpid()}-{time.time_ns()}"))
        key = "h" * 64
        entry_key, lease_key, waiters_key, inflight_key = cache._keys(key)
        try:
            assert (await cache.claim(key, "B", b'{"request_id": "B"}', lease_ms=60_000)).outcome == "lead"
            assert (await cache.claim(key, "C", b'{"request_id": "C"}', lease_ms=60_000)).outcome == "wait"
            # a replay of an earlier holder A's error result: not A's lease, nothing handed over
            assert await cache.complete_begin(key, None, 0, holder="A") is None
            assert await cache.client.get(lease_key) == b"B"
            assert await cache.client.lrange(waiters_key, 0, -1) == [b'{"request_id": "C"}']
            # B's own error result takes C
            assert await cache.complete_begin(key, None, 0, holder="B") == [b'{"request_id": "C"}']
            await cache.complete_end(key, 1)
            assert await cache.client.exists(lease_key, waiters_key) == 0
            # a lapsed lease (nobody's): a late result completes whoever still waits
            await cache.client.rpush(waiters_key, b'{"request_id": "D"}')
            assert await cache.complete_begin(key, None, 0, holder="A") == [b'{"request_id": "D"}']
            # a result that is cached takes the waiters whoever holds the lease (it is right for every copy)
            assert (await cache.claim(key, "E", b'{"request_id": "E"}', lease_ms=60_000)).outcome == "lead"
            assert await cache.complete_begin(key, CacheEntry("s3://b/results/h.json", 1, 1, 1), 60,
                                              holder="A") == [b'{"request_id": "D"}']
        finally:
            await cache.client.delete(entry_key, lease_key, waiters_key, inflight_key)
            await cache.close()

    asyncio.run(go())


def test_the_reaper_decides_when_a_holder_is_replaced_and_waiters_never_expire(stack_env):
    """The lease key expires only as a backstop (4 lease periods); the deadline in the in-flight set
    is what the reaper acts on: ``extend`` renews a passed deadline only, the deadline-based
    ``promote`` refuses a key whose deadline is ahead, ``unheld_only`` refuses a held lease, and
    the waiter list has no expiry at all."""

    async def go():
        cache = ResultCache(RedisSettings(key_prefix=f"reaper-test-{os.getpid()}-{time.time_ns()}"))
        key = "r" * 64
        entry_key, lease_key, waiters_key, inflight_key = cache._keys(key)
        try:
            assert (await cache.claim(key, "holder", b'{"request_id": "holder"}', lease_ms=300)).outcome == "lead"
            assert (await cache.claim(key, "copy", b'{"request_id": "copy"}', lease_ms=300)).outcome == "wait"
            assert 900 < await cache.client.pttl(lease_key) <= 1200  # 4 x 300 ms backstop
            assert await cache.client.pttl(waiters_key) == -1
            assert await cache.extend(key, 300) is False  # deadline not passed yet
            assert await cache.promote(key, 300) == Promotion("busy")
            await asyncio.sleep(0.4)  # deadline passed, lease key still there
            assert await cache.expired_leases() == [key]
            assert await cache.promote(key, 300, unheld_only=True) == Promotion("held")
            assert await cache.extend(key, 60_000) is True
            assert await cache.extend(key, 60_000) is False  # a second reaper: already renewed
            assert await cache.expired_leases() == []
            assert 239_000 < await cache.client.pttl(lease_key) <= 240_000  # backstop pushed out too
            assert await cache.client.get(lease_key) == b"holder"
            # the deadline passes again and the holder is judged gone: the copy takes the lease
            await cache.client.zadd(inflight_key, {key: 0})
            outcome, raw, *_ = await cache.promote(key, 60_000)
            assert outcome == "promoted" and raw == b'{"request_id": "copy"}'
            assert await cache.client.get(lease_key) == b"copy"
            assert await cache.client.llen(waiters_key) == 0
        finally:
            await cache.client.delete(entry_key, lease_key, waiters_key, inflight_key)
            await cache.close()

    asyncio.run(go())


def test_a_success_closes_the_redis_circuit_breaker(stack_env):
    """After the open period one call reaches the real Redis; its success closes the breaker."""

    async def go():
        cache = ResultCache(RedisSettings(breaker_failures=1, breaker_open_ms=300))
        try:
            cache._failures, cache._open_until = 1, time.monotonic() + 0.3  # as after one failure
            with pytest.raises(CacheUnavailable, match="circuit breaker open"):
                await cache.get("k")
            await asyncio.sleep(0.35)
            assert await cache.get("nothing-here") is None  # the trial call reached the real Redis
            assert cache._failures == 0
            assert await cache.get("nothing-here") is None
        finally:
            await cache.close()

    asyncio.run(go())


def test_a_promoted_waiter_is_never_forgotten(stack_env):
    """A promotion pops a waiter and makes it the holder; if the reply is lost (Redis slow past
    the budget) or its sender dies before producing its event, that request was never sent. The
    promoted waiter is kept (no expiry, like the waiters) until its key completes: the reaper
    finding it due sends it again, PROMOTED_MAX_SENDS times in all, then gives it up (the caller
    ends it with an error) and promotes the next; a lapsed lease's record becomes a new lead's
    waiter; a result of another request completes it as a waiter; and the sink's promotion after
    its own error drops it."""

    async def go():
        cache = ResultCache(RedisSettings(key_prefix=f"held-test-{os.getpid()}-{time.time_ns()}"))
        key = "p" * 64
        entry_key, lease_key, waiters_key, inflight_key = cache._keys(key)
        held_key = cache._held_key(key)
        w = {r: b'{"request_id": "%s"}' % r.encode() for r in "ABCDEFG"}
        try:
            assert (await cache.claim(key, "A", w["A"], lease_ms=60_000)).outcome == "lead"
            for rid in "BC":
                assert (await cache.claim(key, rid, w[rid], lease_ms=60_000)).outcome == "wait"
            # the sink, after A's retryable error, promotes B (attempt 2); suppose the reply never arrived
            assert await cache.promote(key, 60_000, expected_holder="A", attempt=2) == Promotion("promoted", w["B"], None, 2)
            assert await cache.client.hgetall(held_key) == {b"w": w["B"], b"n": b"1", b"a": b"2"}
            assert await cache.client.pttl(held_key) == -1  # it exists only here: no expiry
            # the reaper finds B due (deadline passed, nothing of it in Kafka): B is sent again, same attempt
            for sends in (2, 3):
                await cache.client.zadd(inflight_key, {key: 0})
                assert await cache.promote(key, 60_000) == Promotion("resent", w["B"], None, 2)
                assert await cache.client.get(lease_key) == b"B"
                assert await cache.client.hget(held_key, "n") == str(sends).encode()
            # sent PROMOTED_MAX_SENDS times and never finished: given up, and C promoted
            assert PROMOTED_MAX_SENDS == 3
            await cache.client.zadd(inflight_key, {key: 0})
            assert await cache.promote(key, 60_000) == Promotion("promoted", w["C"], w["B"], 2)
            assert await cache.client.llen(waiters_key) == 0
            # B is kept until its error result is acknowledged: a lost reply cannot forget it
            assert await cache.given_up() == [w["B"]]
            await cache.forget_given_up(["B"])
            assert await cache.given_up() == []
            # C's lease lapses (its backstop expiry ran out) but its record stays: sent again
            await cache.client.delete(lease_key)
            assert await cache.promote(key, 60_000, unheld_only=True) == Promotion("resent", w["C"], None, 2)
            # it lapses again and D arrives: D leads, and C becomes D's first waiter
            await cache.client.delete(lease_key)
            assert (await cache.claim(key, "D", w["D"], lease_ms=60_000)).outcome == "lead"
            assert await cache.client.lrange(waiters_key, 0, -1) == [w["C"]]
            assert await cache.client.exists(held_key) == 0
            assert await cache.promote(key, 60_000, expected_holder="D", attempt=2) == Promotion("promoted", w["C"], None, 2)
            # a result cached by another request (a late replay of D's): C joins the waiters it completes
            got = await cache.complete_begin(key, CacheEntry("s3://b/results/p.json", 1, 1, 1), 60, holder="D")
            assert got == [w["C"]] and await cache.client.exists(held_key) == 0
            await cache.complete_end(key, len(got))
            assert await cache.client.exists(lease_key, waiters_key, held_key) == 0
            # the sink's promotion after a promoted holder's own error drops its record
            await cache.client.delete(entry_key)
            assert (await cache.claim(key, "E", w["E"], lease_ms=60_000)).outcome == "lead"
            for rid in "FG":
                assert (await cache.claim(key, rid, w[rid], lease_ms=60_000)).outcome == "wait"
            assert (await cache.promote(key, 60_000, expected_holder="E", attempt=2)).raw == w["F"]
            assert await cache.promote(key, 60_000, expected_holder="F", attempt=3) == Promotion("promoted", w["G"], None, 3)
            assert await cache.client.hget(held_key, "w") == w["G"]
            # ... but a late error of another request puts a lapsed holder's record back at the head
            await cache.client.delete(lease_key)
            assert await cache.promote(key, 60_000, expected_holder="X", attempt=2) == Promotion("promoted", w["G"], None, 2)
            # G's own result: its record goes with the lease
            assert await cache.complete_begin(key, None, 0, holder="G") == []
            await cache.complete_end(key, 0)
            assert await cache.client.exists(lease_key, waiters_key, held_key) == 0
        finally:
            await cache.client.delete(entry_key, lease_key, waiters_key, inflight_key, held_key)
            await cache.close()

    asyncio.run(go())
