"""Per-key token buckets and daily quotas in Redis (one atomic Lua script per request).

Keys (``<p>`` is ``redis.key_prefix``):

* ``<p>:rl:<key_id>``           hash ``{tokens, ts}``: tokens left (float) at ``ts`` (Unix ms).
  Expires once the bucket would be full again (an absent bucket *is* a full one).
* ``<p>:quota:<key_id>:<day>``  submissions counted on UTC day number ``day`` (Unix ms // 86,400,000);
  expires after two days. A ``POST /v1/ocr`` counts one (:meth:`RateLimiter.hit`); a batch one
  per image, all at once, in the same call that takes its tokens (``hit(cost=N)``).

The bucket holds at most ``burst`` tokens and refills at ``rate_per_s`` tokens per second,
continuously, by the time elapsed since ``ts``. A request costs ``cost`` tokens (and submissions):
one for ``POST /v1/ocr`` and every other route, one per image for a batch. It needs
``max(1, min(cost, burst))`` tokens in the bucket, else it is refused whole (nothing taken) and
told to retry after the time until that many have refilled, ``ceil((need - tokens) / rate_per_s)``
seconds; allowed, it takes all ``cost``. A batch larger than the burst is therefore let through
from a full bucket only, and leaves it below zero: later requests wait until the debt has
refilled (the long-run rate stays ``rate_per_s`` images per second). ``cost`` 0 takes and counts
nothing but still needs one token and one submission left (:meth:`RateLimiter.peek`: a batch is
refused before its body is read when even its first image could not pass). The clock is Redis ``TIME`` (one clock for every
replica of the door), unless the caller passes ``now_ms`` (tests). If a passed clock goes
backwards, nothing is refilled and the later stamp is kept.

A refused request takes no token and does not count against the quota; a request refused by
the quota takes no token.

Redis trouble never stops OCR: when Redis errors or does not answer within its time budget,
the request is let through (outcome ``unavailable``, counted by the caller in
``ocrstream_rate_limit_total``). Limits are then not enforced until Redis answers again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.cache.entries import CacheEntry, CacheUnavailable, ResultCache

DAY_MS = 86_400_000


def _clock(argv: int) -> str:
    """Lua that sets ``now`` (Unix ms) from ``ARGV[argv]``, or from Redis ``TIME`` when that is ''
    (one clock for every replica of the door)."""
    return f"""local now = tonumber(ARGV[{argv}])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: bucket, quota base   ARGV: rate_per_s (0 = no bucket), burst, quota (0 = none), now_ms ('' = TIME),
# cost (tokens taken and submissions counted; 0 = only check that one of each is left)
# Refuses with {code, wait_ms, tokens}: code 0 rate limited (tokens: in the bucket), 2 quota exceeded
# (tokens: submissions left today); else takes `cost` tokens and counts `cost` submissions, leaving
# `tokens` for the tail that follows.
_TAKE = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local quota = tonumber(ARGV[3])
local cost = tonumber(ARGV[5])
""" + _clock(4) + """local qkey = nil
if quota > 0 then
  local day = math.floor(now / 86400000)
  qkey = KEYS[2] .. ':' .. string.format('%d', day)
  local used = tonumber(redis.call('GET', qkey) or '0')
  if used + math.max(cost, 1) > quota then
    return {2, math.ceil((day + 1) * 86400000 - now), tostring(math.max(quota - used, 0))}
  end
end
local tokens = burst
if rate > 0 then
  local st = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local ts = tonumber(st[2])
  tokens = tonumber(st[1])
  if tokens == nil or ts == nil then
    tokens = burst
    ts = now
  elseif now > ts then
    tokens = tokens + (now - ts) * rate / 1000
    ts = now
  end
  if tokens > burst then tokens = burst end
  local need = math.max(1, math.min(cost, burst))
  if tokens < need then
    return {0, math.ceil((need - tokens) * 1000 / rate), tostring(tokens)}
  end
  if cost > 0 then
    tokens = tokens - cost
    redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', string.format('%.3f', ts))
    redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) * 1000 / rate) + 1000)
  end
end
if qkey and cost > 0 then
  redis.call('INCRBY', qkey, cost)
  redis.call('PEXPIRE', qkey, 2 * 86400000)
end
"""

# Returns {code, wait_ms, tokens}: code 1 allowed, 0 rate limited, 2 quota exceeded.
_HIT = _TAKE + """return {1, 0, tostring(tokens)}
"""

# The HTTP door's cached path in one round trip: _TAKE, then, if allowed, the cache entry (and on a
# hit the request's accepted marker, as ResultCache.get_and_mark).
# KEYS: bucket, quota base, cache entry, accepted marker   ARGV: as _HIT (cost 1), then marker value ('' = none),
# marker ttl s.  Returns {code, wait_ms, tokens, entry ('' = miss)}.
_HIT_LOOKUP = _TAKE + """local hit = redis.call('GET', KEYS[3])
if hit and ARGV[6] ~= '' then redis.call('SET', KEYS[4], ARGV[6], 'EX', ARGV[7]) end
return {1, 0, tostring(tokens), hit or ''}
"""


# KEYS: quota base   ARGV: n (> 0), quota (> 0), now_ms ('' = TIME)
# Returns {code, wait_ms, left}: code 1 counted, 2 quota exceeded (nothing counted); left = the
# day's submissions left before this charge.
_COUNT = """
local n = tonumber(ARGV[1])
local quota = tonumber(ARGV[2])
""" + _clock(3) + """local day = math.floor(now / 86400000)
local qkey = KEYS[1] .. ':' .. string.format('%d', day)
local used = tonumber(redis.call('GET', qkey) or '0')
if used + n > quota then
  return {2, math.ceil((day + 1) * 86400000 - now), quota - used}
end
redis.call('INCRBY', qkey, n)
redis.call('PEXPIRE', qkey, 2 * 86400000)
return {1, 0, quota - used}
"""


@dataclass(frozen=True)
class Decision:
    """The outcome of one request against its key's limits.

    Attributes:
        allowed: Whether the request may proceed.
        outcome: ``ok``, ``unlimited`` (no limit applies, Redis not asked), ``rate_limited``,
            ``quota_exceeded`` or ``unavailable`` (Redis down: allowed, fail open).
        retry_after_s: When refused, whole seconds until a retry can succeed (rounded up, >= 1);
            else 0. This is the ``Retry-After`` header (RFC 9110 §10.2.3).
        tokens: Tokens left in the bucket after this request (``burst`` when no bucket applies).
    """

    allowed: bool
    outcome: str
    retry_after_s: int = 0
    tokens: float = 0.0


class RateLimiter:
    """Token buckets and daily quotas per API key.

    Args:
        cache: The door's result cache: its Redis pool, key prefix (``redis.key_prefix``) and
            time budget per call (``redis.timeout_ms``, with its timing and error metrics).
    """

    def __init__(self, cache: ResultCache):
        self.cache = cache
        self.client = cache.client
        self.prefix = cache.p
        self._hit = cache.client.register_script(_HIT)
        self._hit_lookup = cache.client.register_script(_HIT_LOOKUP)
        self._count = cache.client.register_script(_COUNT)

    async def hit(self, key_id: str, *, rate_per_s: float, burst: int, quota_per_day: int = 0,
                  now_ms: float | None = None, cost: int = 1) -> Decision:
        """Take ``cost`` tokens from ``key_id``'s bucket and count ``cost`` against its daily quota,
        all or none (the module docstring says what the bucket must hold).

        Args:
            key_id: The API key's id.
            rate_per_s: Refill, tokens/s; 0 = no rate limit.
            burst: Bucket size, tokens (>= 1).
            quota_per_day: Requests counted per UTC day; 0 = no quota (not counted at all).
            now_ms: Clock, Unix ms; None = Redis ``TIME``.
            cost: Tokens (and submissions) this request costs: 1, or a batch's images; 0 takes
                nothing and only checks that one token and one submission are left (:meth:`peek`).

        Returns:
            The decision: ``tokens`` is what the bucket holds after it (refused by the bucket:
            what it holds now; refused by the quota: the submissions left today).
            ``unavailable`` (allowed) when Redis errors or is too slow.
        """
        if rate_per_s <= 0 and quota_per_day <= 0:
            return Decision(True, "unlimited", tokens=float(burst))
        keys = [f"{self.prefix}:rl:{key_id}", f"{self.prefix}:quota:{key_id}"]
        args = [repr(float(rate_per_s)), int(burst), int(quota_per_day), "" if now_ms is None else repr(float(now_ms)),
                max(0, int(cost))]
        try:
            code, wait_ms, tokens = await self.cache.call("ratelimit", self._hit(keys=keys, args=args))
        except CacheUnavailable:
            return Decision(True, "unavailable")
        tokens = float(tokens)
        if code == 1:
            return Decision(True, "ok", tokens=tokens)
        retry = max(1, math.ceil(int(wait_ms) / 1000))
        return Decision(False, "rate_limited" if code == 0 else "quota_exceeded", retry, tokens)

    async def peek(self, key_id: str, *, rate_per_s: float, burst: int, quota_per_day: int = 0,
                   now_ms: float | None = None) -> Decision:
        """Whether ``key_id`` has one token and one submission left, taking nothing (``hit(cost=0)``):
        a batch is refused before its body is read when not even its first image could pass.

        Returns:
            As :meth:`hit`; nothing is taken or counted either way.
        """
        return await self.hit(key_id, rate_per_s=rate_per_s, burst=burst, quota_per_day=quota_per_day,
                              now_ms=now_ms, cost=0)

    async def hit_and_lookup(self, key_id: str, cache_key: str, request_id: str, marker: bytes, marker_ttl_s: int, *,
                             rate_per_s: float, burst: int, quota_per_day: int = 0,
                             now_ms: float | None = None) -> tuple[Decision, CacheEntry | None]:
        """:meth:`hit`, then, if allowed, :meth:`ResultCache.get_and_mark` of ``cache_key``, in one
        Redis round trip (the HTTP door's path for a small body it has already read: the cached
        answer then costs one call, not two).

        Args:
            key_id, rate_per_s, burst, quota_per_day, now_ms: As :meth:`hit`.
            cache_key: The upload's cache key (``<gen_id>:<sha256>``).
            request_id: The request's id; on a hit it is marked accepted with ``marker``
                (empty: no marker) for ``marker_ttl_s`` seconds.

        Returns:
            The decision and, when allowed, the cache entry (None on a miss). Redis down or
            slow: ``unavailable`` (allowed) and None (a miss), as :meth:`hit` and the cache do.
        """
        cache = self.cache
        if rate_per_s <= 0 and quota_per_day <= 0:
            try:
                entry = await cache.get_and_mark(cache_key, request_id, marker, marker_ttl_s)
            except CacheUnavailable:
                entry = None
            return Decision(True, "unlimited", tokens=float(burst)), entry
        keys = [f"{self.prefix}:rl:{key_id}", f"{self.prefix}:quota:{key_id}",
                cache.entry_key(cache_key), f"{self.prefix}:req:{request_id}"]
        args = [repr(float(rate_per_s)), int(burst), int(quota_per_day), "" if now_ms is None else repr(float(now_ms)),
                1, marker, int(marker_ttl_s)]
        try:
            res = await cache.call("ratelimit_lookup", self._hit_lookup(keys=keys, args=args))
        except CacheUnavailable:
            return Decision(True, "unavailable"), None
        code, wait_ms, tokens = res[0], res[1], float(res[2])
        if code == 1:
            return Decision(True, "ok", tokens=tokens), (CacheEntry.from_json(res[3]) if res[3] else None)
        retry = max(1, math.ceil(int(wait_ms) / 1000))
        return Decision(False, "rate_limited" if code == 0 else "quota_exceeded", retry, tokens), None

    async def count_quota(self, key_id: str, n: int, *, quota_per_day: int, now_ms: float | None = None) -> Decision:
        """Count ``n`` submissions against ``key_id``'s daily quota, all or none. No token is
        taken. (The door charges a batch with ``hit(cost=N)``, tokens and quota in one call.)

        Args:
            key_id: The API key's id.
            n: Submissions to add (<= 0: nothing to count).
            quota_per_day: The key's quota; 0 = none.
            now_ms: Clock, Unix ms; None = Redis ``TIME``.

        Returns:
            ``ok``; ``quota_exceeded`` (nothing counted; ``tokens`` holds the submissions left
            today) with the seconds until the next UTC day; ``unlimited`` without a quota;
            ``unavailable`` (allowed) when Redis errors or is too slow.
        """
        if n <= 0 or quota_per_day <= 0:
            return Decision(True, "unlimited")
        args = [int(n), int(quota_per_day), "" if now_ms is None else repr(float(now_ms))]
        try:
            code, wait_ms, left = await self.cache.call(
                "ratelimit", self._count(keys=[f"{self.prefix}:quota:{key_id}"], args=args))
        except CacheUnavailable:
            return Decision(True, "unavailable")
        if code == 1:
            return Decision(True, "ok", tokens=float(left))
        return Decision(False, "quota_exceeded", max(1, math.ceil(int(wait_ms) / 1000)), float(left))
