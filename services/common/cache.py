"""The Redis result cache with single flight: one inference per cache key, however many copies.

Keys (prefix ``ocr`` by default; ``<key>`` is a cache key ``<gen_id>:<sha256>``, or
``<gen_id>:<scope>:<sha256>`` with ``OCRSTREAM_CACHE_SCOPE=key``: :func:`schemas.keys.cache_key`):

* ``ocr:c:<key>``      the cache entry: a small JSON pointer to the S3 result document plus a
                       summary (never the document itself), with a TTL per task/source.
* ``ocr:lease:<key>``  the in-flight lease: value = request id of the holder (expiry a backstop only).
* ``ocr:wait:<key>``   list of waiting requests (RequestEvent JSON), completed with the holder; no expiry.
* ``ocr:inflight``     sorted set of keys with a lease, scored by lease deadline (ms), for the reaper.
* ``ocr:held:<key>``   hash (``w``: RequestEvent JSON, ``n``: times sent, ``a``: its attempt) of a
                       waiter promoted to holder, kept until its key completes (no expiry, like the
                       waiters: it exists only here): if the promotion's reply was lost or its
                       sender died before producing it, its event was never sent, and the reaper
                       sends it again instead of forgetting it (:meth:`ResultCache.promote`).
* ``ocr:gaveup``       hash request id -> RequestEvent JSON of promoted waiters given up after
                       :data:`PROMOTED_MAX_SENDS` sends, kept until their error result is
                       acknowledged by Kafka (:meth:`ResultCache.given_up`, :meth:`ResultCache.forget_given_up`).
* ``ocr:gens``         hash gen_id -> generation JSON, so ``cache purge --model REV`` finds entries.
* ``ocr:nd:<gen_id>:*`` near-duplicate index (LSH buckets, ``services/common/neardup_index.py``).

Every call has a time budget (``redis.timeout_ms``). A failed or slow call is counted and
reported to the caller as :class:`CacheUnavailable`; the stages then carry on without the
cache (a miss). After ``redis.breaker_failures`` failures in a row a circuit breaker opens for
``redis.breaker_open_ms``: calls fail at once instead of each waiting out the budget (a hung
Redis would otherwise cost every request 100 ms), then one call tries Redis again, and a
success closes it: no restart needed when Redis returns (the pattern of M. Nygard, "Release
It!", ch. 5, "Circuit Breaker").
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import NamedTuple

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from schemas.keys import CacheGeneration
from services.common.settings import RedisSettings
from services.common.telemetry import Telemetry

PROMOTED_MAX_SENDS = 3
"""How many times in all a promoted waiter is sent to inference (its first send may have been lost
with the promotion's reply) before the reaper gives it up, ending it with an error."""

HIT_WAITERS_MAX = 500
"""At most this many waiters are returned by one :meth:`ResultCache.promote` that finds the result
cached (the rest on the next one)."""

LEASE_KEY_FACTOR = 4
"""The lease key itself expires after this many lease periods, as a backstop only: dedup's reaper
decides when a holder is replaced (by the deadline in ``<prefix>:inflight`` and the backlog of the
stages after it) and pushes this expiry out whenever it extends a holder's deadline."""

# KEYS: entry, lease, waiters, inflight, held   ARGV: request_id, lease_ms, waiter_json, now_ms, cache_key
# The waiter list has no expiry: waiting requests exist only here (their Kafka offsets are
# committed), so they stay until a completion or a promotion takes them. A promoted holder whose
# lease lapsed (its record is still there) becomes the new lead's first waiter.
_CLAIM = """
local hit = redis.call('GET', KEYS[1])
if hit then return {'hit', hit, redis.call('PTTL', KEYS[1])} end
local deadline = tonumber(ARGV[4]) + tonumber(ARGV[2])
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', tonumber(ARGV[2]) * %d) then
  redis.call('ZADD', KEYS[4], deadline, ARGV[5])
  local held = redis.call('HGET', KEYS[5], 'w')
  if held then
    redis.call('LPUSH', KEYS[3], held)
    redis.call('DEL', KEYS[5])
  end
  return {'lead', ''}
end
local holder = redis.call('GET', KEYS[2])
if holder == ARGV[1] then return {'lead', ''} end
redis.call('RPUSH', KEYS[3], ARGV[3])
redis.call('PERSIST', KEYS[3])
return {'wait', holder or ''}
""" % LEASE_KEY_FACTOR

# KEYS: entry, lease, waiters, inflight, held   ARGV: entry_json ('' = do not cache), ttl_ms, holder
# Without an entry (an error, or a result of another generation) the waiters are handed over only
# when the lease is the holder's or nobody's: a late or replayed result must not take the waiters
# (and then the lease) of a newer holder, which will complete them itself.
# A promoted waiter other than this result's own request (its own event may never have been sent)
# joins the waiters handed over: this result is right for it too.
_COMPLETE_BEGIN = """
local holder = redis.call('GET', KEYS[2])
if ARGV[1] ~= '' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
elseif ARGV[3] ~= '' then
  if holder and holder ~= ARGV[3] then return false end
end
local held = redis.call('HGET', KEYS[5], 'w')
if held and cjson.decode(held)['request_id'] ~= ARGV[3] then
  redis.call('LPUSH', KEYS[3], held)
  redis.call('DEL', KEYS[5])
end
return redis.call('LRANGE', KEYS[3], 0, -1)
"""

# The tail of the scripts that remove waiters: the key leaves the reaper's in-flight set once
# nobody waits on it, else it is due at once for the rest. Locals: waiters, inflight, key, now.
_SETTLE_INFLIGHT = """
if redis.call('LLEN', waiters) == 0 then
  redis.call('ZREM', inflight, key)
else
  redis.call('ZADD', inflight, tonumber(now), key)
end
return 1
"""

# KEYS: lease, waiters, inflight, held   ARGV: n_done, cache_key, now_ms
_COMPLETE_END = """
local waiters, inflight, key, now = KEYS[2], KEYS[3], ARGV[2], ARGV[3]
redis.call('LTRIM', waiters, tonumber(ARGV[1]), -1)
redis.call('DEL', KEYS[1], KEYS[4])
""" + _SETTLE_INFLIGHT

# Promote the first waiter to lease holder. KEYS: entry, lease, waiters, inflight, held, gaveup
# ARGV: lease_ms, now_ms, cache_key, expected_holder, unheld_only ('1' or ''), max_sends, attempt
# expected_holder given (the sink, after the holder's retryable error): only if the lease is that
# holder's or nobody's. Else (dedup's reaper): with unheld_only, only if nobody holds the lease
# ('held' otherwise); without, only if the key's deadline has passed, read here, so of two
# reapers that found the same expired key only the first promotes.
# The promoted waiter is also kept in `held` (with `attempt`, the attempt its event carries) until
# its key completes. When the reaper finds that holder due (its lease lapsed, or its deadline
# passed with nothing of it left in Kafka), it may never have been sent (the promotion's reply was
# lost, or its sender died before producing it): it is sent again ('resent', keeping the lease),
# max_sends times in all; after that it is given up ('abandoned', third value: the caller ends it
# with an error; it moves to `gaveup`, where it stays until that error is acknowledged, so a lost
# reply or a dead caller cannot forget it) and the next waiter promoted. The sink's promotion after a holder's own error
# drops that holder's record (it has its final state); a record of another request goes back to
# the head of the waiters.
# With a result cached the lease is stale (its holder stored the entry, then could not release
# it, or its sink is still writing: MariaDB down): the lease goes. Waiters still listed are
# returned (fifth value, the first HIT_WAITERS_MAX): complete_begin gave them to a sink that has
# not finished them, and may never (it deferred them while Redis was down, then died; or its
# outage outlasts the lease), so the caller answers them from the entry and then removes them
# with _REMOVE_WAITERS. Only a reaper that finds the key due gets them (another is 'busy', as
# below), so two dedups never answer, and trim, the same waiters. Until then the key stays in
# flight, due again a lease period on; with no
# waiters left its in-flight mark goes, so the reaper does not meet it again. A promoted holder
# is among the waiters (complete_begin put it there) or completed by its own result.
# Returns {outcome, waiter_json, abandoned_json, attempt[, waiters]}.
_PROMOTE = """
local hit = redis.call('GET', KEYS[1])
if hit then
  if ARGV[4] == '' then
    local due = redis.call('ZSCORE', KEYS[4], ARGV[3])
    if due and tonumber(due) > tonumber(ARGV[2]) then return {'busy', '', '', ''} end
  end
  redis.call('DEL', KEYS[2], KEYS[5])
  local ws = redis.call('LRANGE', KEYS[3], 0, %d - 1)
  if #ws == 0 then
    redis.call('ZREM', KEYS[4], ARGV[3])
  else
    redis.call('ZADD', KEYS[4], tonumber(ARGV[2]) + tonumber(ARGV[1]), ARGV[3])
  end
  return {'hit', hit, '', '', ws}
end
local holder = redis.call('GET', KEYS[2])
if ARGV[4] ~= '' then
  if holder and holder ~= ARGV[4] then return {'busy', '', '', ''} end
elseif ARGV[5] == '1' then
  if holder then return {'held', '', '', ''} end
else
  local due = redis.call('ZSCORE', KEYS[4], ARGV[3])
  if due and tonumber(due) > tonumber(ARGV[2]) then return {'busy', '', '', ''} end
end
local held = redis.call('HGET', KEYS[5], 'w')
local abandoned = ''
if held then
  local rid = cjson.decode(held)['request_id']
  if ARGV[4] == '' and ((not holder) or holder == rid) then
    local n = redis.call('HINCRBY', KEYS[5], 'n', 1)
    if n <= tonumber(ARGV[6]) then
      redis.call('SET', KEYS[2], rid, 'PX', tonumber(ARGV[1]) * %d)
      redis.call('ZADD', KEYS[4], tonumber(ARGV[2]) + tonumber(ARGV[1]), ARGV[3])
      return {'resent', held, '', redis.call('HGET', KEYS[5], 'a') or '2'}
    end
    abandoned = held
    redis.call('HSET', KEYS[6], rid, held)
  elseif ARGV[4] ~= '' and rid ~= ARGV[4] then
    redis.call('LPUSH', KEYS[3], held)
  end
  redis.call('DEL', KEYS[5])
end
local w = redis.call('LPOP', KEYS[3])
if not w then
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[4], ARGV[3])
  return {'none', '', abandoned, ''}
end
redis.call('SET', KEYS[2], cjson.decode(w)['request_id'], 'PX', tonumber(ARGV[1]) * %d)
redis.call('HSET', KEYS[5], 'w', w, 'n', 1, 'a', ARGV[7])
redis.call('ZADD', KEYS[4], tonumber(ARGV[2]) + tonumber(ARGV[1]), ARGV[3])
return {'promoted', w, abandoned, ARGV[7]}
""" % (HIT_WAITERS_MAX, LEASE_KEY_FACTOR, LEASE_KEY_FACTOR)

# Give a holder that is still on its way a new deadline. KEYS: lease, inflight
# ARGV: lease_ms, now_ms, cache_key. Only a key whose deadline has passed (not one a promotion or
# another reaper just renewed) and that somebody still holds (waiters a released lease left behind
# are due at once and must stay so); returns 1 if extended.
_EXTEND = """
local due = redis.call('ZSCORE', KEYS[2], ARGV[3])
if (not due) or tonumber(due) > tonumber(ARGV[2]) then return 0 end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], tonumber(ARGV[2]) + tonumber(ARGV[1]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * %d)
return 1
""" % LEASE_KEY_FACTOR


# Remove waiters answered from the cache by dedup's reaper (promote's 'hit'), each by its own
# JSON, not by count: if two reapers ever answered the same waiters, neither removes one that
# nobody answered. KEYS: waiters, inflight   ARGV: cache_key, now_ms, waiter_json...
_REMOVE_WAITERS = """
local waiters, inflight, key, now = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
for i = 3, #ARGV do redis.call('LREM', waiters, 1, ARGV[i]) end
""" + _SETTLE_INFLIGHT

# KEYS: entry, accepted-marker   ARGV: marker value, marker ttl s
_GET_AND_MARK = """
local hit = redis.call('GET', KEYS[1])
if hit and ARGV[1] ~= '' then redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2]) end
return hit
"""


def durability_problems(config: dict[str, str]) -> list[str]:
    """What makes a Redis unsafe for single flight, from its ``CONFIG GET`` values.

    Requests waiting on an in-flight copy of their image exist only in Redis (``<prefix>:wait:*``):
    a Redis that restarts empty (no AOF) or evicts keys loses them, and they never complete.
    Required: ``appendonly yes`` with ``appendfsync`` ``everysec`` or ``always``, and
    ``maxmemory-policy noeviction`` (names and values as in redis.conf, Redis 6/7).

    Args:
        config: Setting name -> value (``appendonly``, ``appendfsync``, ``maxmemory-policy``);
            a missing name counts as not set.

    Returns:
        One line per problem; empty if none.
    """
    out = []
    if config.get("appendonly") != "yes":
        out.append(f"appendonly is {config.get('appendonly')!r}, not 'yes': a restart loses waiting requests")
    elif config.get("appendfsync") not in ("everysec", "always"):
        out.append(f"appendfsync is {config.get('appendfsync')!r}, not 'everysec': a crash may lose "
                   "more than a second of waiting requests")
    if config.get("maxmemory-policy") != "noeviction":
        out.append(f"maxmemory-policy is {config.get('maxmemory-policy')!r}, not 'noeviction': "
                   "under memory pressure Redis may evict leases and waiting requests")
    return out


class CacheUnavailable(Exception):
    """Redis did not answer within its time budget (or errored). Treat as a miss."""

    retriable = True


@dataclass(frozen=True)
class CacheEntry:
    """A cache entry: where the result document is and a small summary of it."""

    result_uri: str
    line_count: int
    chars: int
    created_at_ms: int

    def to_json(self) -> bytes:
        return orjson.dumps(self.__dict__)

    @classmethod
    def from_json(cls, raw: bytes | str) -> "CacheEntry":
        d = orjson.loads(raw)
        return cls(d["result_uri"], int(d["line_count"]), int(d["chars"]), int(d["created_at_ms"]))


@dataclass(frozen=True)
class Claim:
    """Outcome of :meth:`ResultCache.claim`: ``hit`` (with entry), ``lead`` or ``wait``.

    Attributes:
        ttl_ms: On a hit, the entry's remaining time to live in Redis, ms (``PTTL``, read in the
            same script); None when the entry has no expiry or on ``lead``/``wait``.
    """

    outcome: str
    entry: CacheEntry | None = None
    ttl_ms: int | None = None


class Promotion(NamedTuple):
    """Outcome of :meth:`ResultCache.promote` (see there).

    Attributes:
        outcome: ``promoted``, ``resent``, ``hit``, ``none``, ``busy`` or ``held``.
        raw: The waiter to send (RequestEvent JSON), or on ``hit`` the entry; else None.
        abandoned: A promoted waiter given up after :data:`PROMOTED_MAX_SENDS` sends, or None.
        attempt: The attempt number ``raw``'s ``ocr.infer`` event carries.
    waiters: On ``hit``, waiters still listed (RequestEvent JSON, at most :data:`HIT_WAITERS_MAX`):
        the caller answers them from the entry, then removes them with
        :meth:`ResultCache.remove_waiters`.
    """

    outcome: str
    raw: bytes | None = None
    abandoned: bytes | None = None
    attempt: int = 2
    waiters: tuple[bytes, ...] = ()


class ResultCache:
    """Redis-backed cache and single-flight coordination.

    Args:
        cfg: Redis settings (URL, password, time budget per call, key prefix).
        telemetry: Failures are counted in ``ocrstream_cache{outcome="error"}``.
        stage: Label for the metrics.
    """

    def __init__(self, cfg: RedisSettings, telemetry: Telemetry | None = None, stage: str = "cache"):
        self.cfg = cfg
        self.p = cfg.key_prefix
        self.telemetry = telemetry
        self.stage = stage
        self.timeout = cfg.timeout_ms / 1000
        self._failures = 0  # consecutive failed calls
        self._open_until = 0.0  # monotonic s; calls before it fail at once (breaker open)
        self.client = aioredis.Redis.from_url(
            cfg.url,
            password=cfg.password.get_secret_value() if cfg.password else None,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._claim = self.client.register_script(_CLAIM)
        self._begin = self.client.register_script(_COMPLETE_BEGIN)
        self._end = self.client.register_script(_COMPLETE_END)
        self._promote = self.client.register_script(_PROMOTE)
        self._extend = self.client.register_script(_EXTEND)
        self._get_and_mark = self.client.register_script(_GET_AND_MARK)
        self._remove_waiters = self.client.register_script(_REMOVE_WAITERS)

    def _keys(self, key: str) -> list[str]:
        return [f"{self.p}:c:{key}", f"{self.p}:lease:{key}", f"{self.p}:wait:{key}", f"{self.p}:inflight"]

    def _held_key(self, key: str) -> str:
        """The promoted holder's record for ``key`` (see the module docstring)."""
        return f"{self.p}:held:{key}"

    async def _call(self, op: str, coro):
        if self.telemetry is None:
            return await self._call_raw(op, coro)
        with self.telemetry.store_call("redis", op):
            return await self._call_raw(op, coro)

    async def _call_raw(self, op: str, coro):
        now = time.monotonic()
        if self._failures >= self.cfg.breaker_failures and now >= self._open_until:
            # half-open: this call is the one trial; the others keep failing fast until it ends
            self._open_until = now + self.cfg.breaker_open_ms / 1000
        elif now < self._open_until:
            if hasattr(coro, "close"):
                coro.close()  # never sent
            if self.telemetry:
                self.telemetry.cache.labels(self.stage, "skipped", "breaker").inc()
            raise CacheUnavailable(f"redis {op}: circuit breaker open after {self._failures} failed calls")
        try:
            async with asyncio.timeout(self.timeout):  # no extra task per call, unlike wait_for
                result = await coro
        except (RedisError, OSError, TimeoutError) as exc:
            self._failures += 1
            if self._failures >= self.cfg.breaker_failures:
                self._open_until = time.monotonic() + self.cfg.breaker_open_ms / 1000
            if self.telemetry:
                self.telemetry.cache.labels(self.stage, "error", "redis").inc()
            raise CacheUnavailable(f"redis {op}: {exc!r}") from exc
        self._failures = 0
        self._open_until = 0.0
        return result

    async def call(self, op: str, coro):
        """Await one Redis command (or ``pipeline.execute()``) under the time budget, timed as ``op``.

        Raises:
            CacheUnavailable: Redis errored or did not answer within ``redis.timeout_ms``.
        """
        return await self._call(op, coro)

    async def close(self) -> None:
        """Close the connection pool."""
        await self.client.aclose()

    async def durability(self, timeout_s: float = 5.0) -> list[str]:
        """:func:`durability_problems` of this Redis (``CONFIG GET``; an operator's check, not the
        hot path, so ``timeout_s`` rather than ``redis.timeout_ms``).

        Raises:
            RedisError: Redis refused ``CONFIG`` (managed services often do) or did not answer.
            TimeoutError: no answer within ``timeout_s``.
        """
        config: dict[str, str] = {}
        async with asyncio.timeout(timeout_s):
            for name in ("appendonly", "appendfsync", "maxmemory-policy"):
                got = await self.client.config_get(name)
                config.update({(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                               for k, v in got.items()})
        return durability_problems(config)

    async def ping(self) -> bool:
        """True if Redis answers within the time budget."""
        try:
            return bool(await self._call("ping", self.client.ping()))
        except CacheUnavailable:
            return False

    async def get(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` or None. Raises :class:`CacheUnavailable`."""
        raw = await self._call("get", self.client.get(self._keys(key)[0]))
        return CacheEntry.from_json(raw) if raw else None

    async def claim(self, key: str, request_id: str, waiter_json: bytes, lease_ms: int) -> Claim:
        """Atomically: a hit if cached; else take the in-flight lease (``lead``); else join the
        waiters (``wait``). A replay by the lease holder itself is ``lead`` again.

        Raises:
            CacheUnavailable: Redis down or slow; the caller sends the request on without a lease.
        """
        res = await self._call(
            "claim",
            self._claim(keys=[*self._keys(key), self._held_key(key)], args=[request_id, lease_ms, waiter_json, int(time.time() * 1000), key]),
        )
        outcome = res[0].decode() if isinstance(res[0], bytes) else res[0]
        if outcome == "hit":
            ttl_ms = int(res[2]) if len(res) > 2 else -1
            return Claim("hit", CacheEntry.from_json(res[1]), ttl_ms if ttl_ms >= 0 else None)
        return Claim(outcome)

    async def complete_begin(self, key: str, entry: CacheEntry | None, ttl_s: int,
                             holder: str = "") -> list[bytes] | None:
        """Store the entry (when given) and return the waiters to complete (not yet removed).

        Call :meth:`complete_end` once their completions are durable; a crash in between
        leaves the waiters in place and a replay completes them again (idempotent).

        Args:
            key: The cache key.
            entry: The entry to store, or None for a result that is not cached (an error, or
                output of another generation).
            ttl_s: The entry's TTL, s.
            holder: The request id whose result this is. Without an entry: if another request
                holds the lease (the reaper promoted a waiter, or this is a replay after a newer
                request took the key), the waiters are its to complete. A promoted waiter other
                than ``holder`` (its own event may never have been sent) is handed over first
                among the waiters.

        Returns:
            The waiters (JSON, oldest first), or None when they belong to another lease holder:
            then call nothing else for this key (its lease is not ours to release).
        """
        entry_json = entry.to_json() if entry else b""
        args = [entry_json, ttl_s * 1000, holder]
        raw = await self._call("complete_begin", self._begin(keys=[*self._keys(key), self._held_key(key)], args=args))
        return None if raw is None else list(raw)

    async def complete_end(self, key: str, n_done: int) -> None:
        """Remove the first ``n_done`` waiters and release the lease."""
        k = self._keys(key)
        await self._call(
            "complete_end", self._end(keys=[k[1], k[2], k[3], self._held_key(key)], args=[n_done, key, int(time.time() * 1000)])
        )

    async def promote(self, key: str, lease_ms: int, expected_holder: str = "",
                      unheld_only: bool = False, attempt: int = 2) -> "Promotion":
        """Make the first waiter the new lease holder (deadline ``lease_ms`` from now).

        Args:
            key: The cache key.
            lease_ms: The new holder's lease, ms.
            expected_holder: The request id whose lease this replaces (the sink, after that
                holder's retryable error). Empty (dedup's reaper): only if the key's deadline
                has passed.
            unheld_only: (The reaper, without ``expected_holder``.) Only if nobody holds the
                lease: waiters left behind by a released lease, or a lease whose backstop expiry
                ran out. Returns ``held`` when somebody does.
            attempt: The attempt number the promoted waiter's ``ocr.infer`` event will carry
                (kept with it, for a re-send).

        Returns:
            A :class:`Promotion`: ``promoted`` (send ``raw`` to inference); ``resent`` (the
            reaper only: the holder due is itself a promoted waiter, which may never have been
            sent, because the promotion's reply was lost or its sender died before producing
            it; send ``raw`` again; it keeps the lease, at most :data:`PROMOTED_MAX_SENDS` sends
            in all); ``hit`` (``raw`` is the entry: a result appeared; the stale lease is removed,
            and ``waiters`` lists the waiters still there, to be answered from the entry and then
            removed with :meth:`remove_waiters`; with none, the in-flight mark goes too); ``none`` (nobody waits: the lease is
            released); ``busy`` (another holder has the lease, or the deadline is not, or no
            longer, past); ``held`` (see ``unheld_only``). With ``promoted`` or ``none``,
            ``abandoned`` may hold a promoted waiter sent :data:`PROMOTED_MAX_SENDS` times
            without a result. It is also kept in ``<prefix>:gaveup`` until
            :meth:`forget_given_up`: whoever ends it with an error reads it from :meth:`given_up`
            (the reply of this call may be lost).

        Raises:
            CacheUnavailable: Redis down or slow.
        """
        res = await self._call(
            "promote",
            self._promote(keys=[*self._keys(key), self._held_key(key), f"{self.p}:gaveup"],
                          args=[lease_ms, int(time.time() * 1000), key, expected_holder, "1" if unheld_only else "",
                                PROMOTED_MAX_SENDS, attempt]),
        )
        outcome = res[0].decode() if isinstance(res[0], bytes) else res[0]
        waiters = tuple(res[4]) if len(res) > 4 and res[4] else ()
        return Promotion(outcome, res[1] or None, res[2] or None, int(res[3]) if res[3] else attempt, waiters)

    async def extend(self, key: str, lease_ms: int) -> bool:
        """Give the holder of ``key`` a new deadline ``lease_ms`` from now, if its deadline has passed
        (dedup's reaper, for a holder that is still queued or being computed).

        Returns:
            True if extended; False if the key is no longer in flight or another process
            renewed it first.

        Raises:
            CacheUnavailable: Redis down or slow.
        """
        k = self._keys(key)
        return bool(await self._call(
            "extend", self._extend(keys=[k[1], k[3]], args=[lease_ms, int(time.time() * 1000), key])))

    async def remove_waiters(self, key: str, waiters: list[bytes]) -> None:
        """Remove ``waiters`` (RequestEvent JSON, as :meth:`promote` returned them on ``hit``) once
        they are answered; the key leaves the in-flight set when none are left, else it is due
        at once for the rest.

        Raises:
            CacheUnavailable: Redis down or slow (they are then answered again).
        """
        k = self._keys(key)
        await self._call("remove_waiters", self._remove_waiters(
            keys=[k[2], k[3]], args=[key, int(time.time() * 1000), *waiters]))

    async def given_up(self, limit: int = 100) -> list[bytes]:
        """Promoted waiters given up by :meth:`promote` whose error result is not yet acknowledged:
        RequestEvent JSON, at most ``limit`` (more are returned once these are forgotten).

        Raises:
            CacheUnavailable: Redis down or slow.
        """
        out: list[bytes] = []
        cursor = 0
        while True:
            cursor, found = await self._call("given_up", self.client.hscan(f"{self.p}:gaveup", cursor, count=limit))
            out.extend(found.values())
            if not cursor or len(out) >= limit:
                return out[:limit]

    async def forget_given_up(self, request_ids: list[str]) -> None:
        """Drop given-up waiters from :meth:`given_up` once their error results are acknowledged.

        Raises:
            CacheUnavailable: Redis down or slow (they are then returned, and ended, again).
        """
        if request_ids:
            await self._call("forget_given_up", self.client.hdel(f"{self.p}:gaveup", *request_ids))

    async def expired_leases(self, limit: int = 100) -> list[str]:
        """Cache keys whose lease deadline has passed (candidates for promotion), at most ``limit``.

        Raises:
            CacheUnavailable: Redis down or slow.
        """
        now = int(time.time() * 1000)
        keys = await self._call(
            "expired", self.client.zrangebyscore(f"{self.p}:inflight", "-inf", now, start=0, num=limit)
        )
        return [k.decode() for k in keys]

    async def register_generation(self, gen: CacheGeneration) -> None:
        """Record a generation so ``purge`` can find its entries by model revision."""
        await self._call("hset", self.client.hset(f"{self.p}:gens", gen.gen_id, gen.model_dump_json()))

    async def purge(self, *, model_revision: str | None = None, gen_id: str | None = None) -> tuple[int, int]:
        """Delete every cache entry (and near-duplicate index) of the matching generations.

        The generations' records in ``ocr:gens`` stay (one small hash field each): processes still
        running a purged generation go on making entries, and a later purge must find them too.
        Not bound by the per-call time budget: an operator's command, not the hot path (the
        client's socket timeout still applies to each call). Keys are removed with ``UNLINK``,
        500 per round trip.

        Args:
            model_revision: Purge the generations of this model revision.
            gen_id: Purge this generation id.

        Returns:
            ``(generations matched, entries deleted)``.

        Raises:
            RedisError: Redis down, refusing, or slower than the client's socket timeout.
        """
        gens = await self.client.hgetall(f"{self.p}:gens")
        targets = []
        for gid, raw in gens.items():
            g = CacheGeneration.model_validate_json(raw)
            gid = gid.decode()
            if (model_revision and g.model_revision == model_revision) or (gen_id and gid == gen_id):
                targets.append(gid)
        deleted = 0
        for gid in targets:
            for pattern, counted in ((f"{self.p}:c:{gid}:*", True), (f"{self.p}:nd:{gid}:*", False)):
                batch: list[bytes] = []
                async for k in self.client.scan_iter(match=pattern, count=1000):
                    batch.append(k)
                    if len(batch) >= 500:
                        n = await self.client.unlink(*batch)
                        deleted += n if counted else 0
                        batch = []
                if batch:
                    n = await self.client.unlink(*batch)
                    deleted += n if counted else 0
        return len(targets), deleted

    # -- requests accepted over HTTP, not yet completed ----------------------------------------
    async def mark_accepted(self, request_id: str, value: bytes, ttl_s: int) -> None:
        """Remember an accepted request (``<prefix>:req:<id>`` = ``value``, expiring after ``ttl_s``)
        so ``GET /v1/ocr/{id}`` can tell "pending" from "unknown". Raises :class:`CacheUnavailable`."""
        await self._call("set", self.client.set(f"{self.p}:req:{request_id}", value, ex=ttl_s))

    async def accepted(self, request_id: str) -> bytes | None:
        """The value stored by :meth:`mark_accepted`, or None. Raises :class:`CacheUnavailable`."""
        return await self._call("get", self.client.get(f"{self.p}:req:{request_id}"))

    async def get_and_mark(self, key: str, request_id: str, value: bytes, ttl_s: int) -> CacheEntry | None:
        """The entry for ``key`` or None, and on a hit also :meth:`mark_accepted` for
        ``request_id`` (``value`` empty: no marker), in one round trip (the HTTP door's cached
        path). Raises :class:`CacheUnavailable`."""
        raw = await self._call("get_and_mark", self._get_and_mark(
            keys=[self._keys(key)[0], f"{self.p}:req:{request_id}"], args=[value, ttl_s]))
        return CacheEntry.from_json(raw) if raw else None
