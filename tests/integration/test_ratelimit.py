"""The token bucket and daily quota Lua script on the real Redis, with an explicit clock (exact values)."""

from __future__ import annotations

import uuid

import pytest

from services.common.cache.entries import ResultCache
from services.common.settings import RedisSettings
from services.api.ratelimit import DAY_MS, RateLimiter

pytestmark = pytest.mark.stack

T0 = 1_750_000_000_000.0  # a fixed Unix ms; 10:13:20 UTC


@pytest.fixture
async def limiter():
    prefix = f"t{uuid.uuid4().hex[:8]}"
    cache = ResultCache(RedisSettings(key_prefix=prefix, timeout_ms=2000))
    yield RateLimiter(cache)
    async for k in cache.client.scan_iter(match=f"{prefix}:*"):
        await cache.client.delete(k)
    await cache.close()


async def test_bucket_allows_burst_then_refills_by_elapsed_time(limiter):
    hit = lambda now: limiter.hit("k1", rate_per_s=2, burst=3, now_ms=T0 + now)  # noqa: E731
    got = [await hit(0) for _ in range(4)]
    assert [d.outcome for d in got] == ["ok", "ok", "ok", "rate_limited"]
    assert [d.tokens for d in got[:3]] == [2.0, 1.0, 0.0]
    assert got[3].allowed is False and got[3].retry_after_s == 1  # 500 ms to one token, rounded up
    # 250 ms later half a token has refilled: still refused; a refusal takes nothing
    d = await hit(250)
    assert d.outcome == "rate_limited" and d.tokens == 0.5 and d.retry_after_s == 1
    d = await hit(500)
    assert d.outcome == "ok" and d.tokens == 0.0
    # a long pause refills to the burst, never beyond it
    got = [await hit(60_000) for _ in range(4)]
    assert [d.outcome for d in got] == ["ok", "ok", "ok", "rate_limited"]


async def test_retry_after_is_whole_seconds_rounded_up(limiter):
    d1 = await limiter.hit("slow", rate_per_s=0.01, burst=1, now_ms=T0)
    d2 = await limiter.hit("slow", rate_per_s=0.01, burst=1, now_ms=T0 + 1)
    assert d1.outcome == "ok" and d2.outcome == "rate_limited"
    # 0.00001 tokens refilled in 1 ms: 99,999 ms to go -> 100 s
    assert d2.retry_after_s == 100


async def test_buckets_are_per_key_and_expire_when_full_again(limiter):
    assert (await limiter.hit("a", rate_per_s=1, burst=1, now_ms=T0)).outcome == "ok"
    assert (await limiter.hit("a", rate_per_s=1, burst=1, now_ms=T0)).outcome == "rate_limited"
    assert (await limiter.hit("b", rate_per_s=1, burst=1, now_ms=T0)).outcome == "ok"
    ttl = await limiter.client.pttl(f"{limiter.prefix}:rl:a")
    assert 1_000 < ttl <= 2_000  # 1 s to refill one token + 1 s slack


async def test_clock_going_backwards_refills_nothing(limiter):
    assert (await limiter.hit("c", rate_per_s=1, burst=2, now_ms=T0 + 10_000)).tokens == 1.0
    d = await limiter.hit("c", rate_per_s=1, burst=2, now_ms=T0)  # another replica's slower clock
    assert d.outcome == "ok" and d.tokens == 0.0
    d = await limiter.hit("c", rate_per_s=1, burst=2, now_ms=T0 + 10_500)  # refill from the later stamp
    assert d.outcome == "rate_limited" and d.tokens == 0.5


async def test_daily_quota_counts_allowed_requests_and_resets_at_utc_midnight(limiter):
    day_end = (T0 // DAY_MS + 1) * DAY_MS
    hit = lambda now, rate=0: limiter.hit("q", rate_per_s=rate, burst=1, quota_per_day=3, now_ms=now)  # noqa: E731
    assert (await hit(T0)).outcome == "ok"
    assert (await hit(T0 + 1, rate=0.001)).outcome == "ok"
    # refused by the bucket: does not count against the quota
    assert (await hit(T0 + 2, rate=0.001)).outcome == "rate_limited"
    assert (await hit(T0 + 3)).outcome == "ok"
    d = await hit(T0 + 4)
    assert d.outcome == "quota_exceeded" and d.allowed is False
    assert d.retry_after_s == int((day_end - T0 - 4 + 999) // 1000)
    assert int(await limiter.client.get(f"{limiter.prefix}:quota:q:{int(T0 // DAY_MS)}")) == 3
    assert (await hit(day_end)).outcome == "ok"  # a new UTC day


async def test_count_quota_is_all_or_nothing_against_the_day(limiter):
    day = int(T0 // DAY_MS)
    assert (await limiter.hit("b", rate_per_s=0, burst=1, quota_per_day=5, now_ms=T0)).outcome == "ok"  # 1 used
    d = await limiter.count_quota("b", 3, quota_per_day=5, now_ms=T0 + 1)
    assert d.outcome == "ok" and d.tokens == 4.0  # 4 left before it
    d = await limiter.count_quota("b", 2, quota_per_day=5, now_ms=T0 + 2)
    assert d.outcome == "quota_exceeded" and d.tokens == 1.0 and not d.allowed
    assert d.retry_after_s == int(((day + 1) * DAY_MS - T0 - 2 + 999) // 1000)
    assert int(await limiter.client.get(f"{limiter.prefix}:quota:b:{day}")) == 4  # nothing counted
    assert (await limiter.count_quota("b", 1, quota_per_day=5, now_ms=T0 + 3)).outcome == "ok"
    assert (await limiter.count_quota("b", 0, quota_per_day=5, now_ms=T0 + 4)).outcome == "unlimited"
    assert (await limiter.count_quota("b", 9, quota_per_day=0, now_ms=T0 + 5)).outcome == "unlimited"


async def test_no_limit_does_not_touch_redis_and_redis_down_fails_open():
    down = RateLimiter(ResultCache(RedisSettings(url="redis://127.0.0.1:1/0", key_prefix="x", timeout_ms=500)))
    d = await down.hit("k", rate_per_s=0, burst=5)
    assert d.allowed and d.outcome == "unlimited"
    d = await down.hit("k", rate_per_s=1, burst=1)
    assert d.allowed and d.outcome == "unavailable"
    await down.client.aclose()


async def test_redis_clock_is_used_when_no_time_is_passed(limiter):
    got = [await limiter.hit("live", rate_per_s=0.001, burst=2) for _ in range(3)]
    assert [d.outcome for d in got] == ["ok", "ok", "rate_limited"]
    assert 999 <= got[2].retry_after_s <= 1000


async def test_a_cost_of_n_takes_n_tokens_all_or_none(limiter):
    hit = lambda cost, now=0: limiter.hit("n", rate_per_s=1, burst=5, now_ms=T0 + now, cost=cost)  # noqa: E731
    d = await hit(3)
    assert d.outcome == "ok" and d.tokens == 2.0
    d = await hit(3)  # 2 tokens left: refused whole, nothing taken
    assert d.outcome == "rate_limited" and d.tokens == 2.0 and d.retry_after_s == 1
    d = await hit(2)
    assert d.outcome == "ok" and d.tokens == 0.0
    assert (await hit(1)).outcome == "rate_limited"  # the next single image: refused


async def test_a_cost_over_the_burst_passes_a_full_bucket_only_and_leaves_a_debt(limiter):
    hit = lambda cost, now=0: limiter.hit("debt", rate_per_s=2, burst=4, now_ms=T0 + now, cost=cost)  # noqa: E731
    assert (await hit(1)).outcome == "ok"
    d = await hit(10)  # needs the whole burst (4); 3 there
    assert d.outcome == "rate_limited" and d.tokens == 3.0 and d.retry_after_s == 1  # 500 ms to the 4th
    d = await hit(10, 500)
    assert d.outcome == "ok" and d.tokens == -6.0
    d = await hit(1, 500)  # 7 tokens short of one: 3.5 s
    assert d.outcome == "rate_limited" and d.retry_after_s == 4
    assert (await hit(1, 4000)).outcome == "ok"  # 3.5 s later the debt is paid and one token is back
    ttl = await limiter.client.pttl(f"{limiter.prefix}:rl:debt")
    assert 2_000 < ttl <= 3_000  # 4 tokens to refill at 2/s + 1 s slack


async def test_peek_takes_nothing_and_a_batch_counts_n_submissions(limiter):
    day = int(T0 // DAY_MS)
    kw = dict(rate_per_s=1, burst=3, quota_per_day=5)
    for _ in range(3):
        d = await limiter.peek("p", now_ms=T0, **kw)
        assert d.outcome == "ok" and d.tokens == 3.0
    assert await limiter.client.get(f"{limiter.prefix}:quota:p:{day}") is None  # nothing counted
    assert await limiter.client.exists(f"{limiter.prefix}:rl:p") == 0  # nothing taken (an absent bucket is full)
    assert (await limiter.hit("p", now_ms=T0, cost=3, **kw)).outcome == "ok"
    assert int(await limiter.client.get(f"{limiter.prefix}:quota:p:{day}")) == 3
    assert (await limiter.peek("p", now_ms=T0, **kw)).outcome == "rate_limited"
    d = await limiter.hit("p", now_ms=T0 + 60_000, cost=3, **kw)  # tokens back, but 2 submissions left today
    assert d.outcome == "quota_exceeded" and d.tokens == 2.0
    assert (await limiter.hit("p", now_ms=T0 + 60_000, cost=2, **kw)).outcome == "ok"
    d = await limiter.peek("p", now_ms=T0 + 120_000, **kw)
    assert d.outcome == "quota_exceeded" and d.tokens == 0.0
