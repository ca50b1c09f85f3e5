"""The Redis result cache: a pointer to each cache key's stored result, so repeats are answered at once.

Redis is a cache you can lose. Single flight (one inference per cache key however many copies
arrive together) is dedup's keyed state in Kafka (:mod:`services.dedup.state`), not Redis; a
flushed, evicting, restarted or unreachable Redis costs latency (dedup then finds the stored
result document in S3, the third tier), never a lost request or a second inference of an image
already read. AOF and ``noeviction`` are recommended for hit rate only.

Keys (prefix ``ocr`` by default; ``<key>`` is a cache key ``<gen_id>:<sha256>``, or
``<gen_id>:<scope>:<sha256>`` with ``OCRSTREAM_CACHE_SCOPE=key``: :func:`schemas.keys.cache_key`):

* ``ocr:c:<key>``      the cache entry: a small JSON pointer to the S3 result document plus a
                       summary (never the document itself), with a TTL per task/source.
* ``ocr:gens``         hash gen_id -> generation JSON, so ``cache purge --model REV`` finds entries.
* ``ocr:nd:<gen_id>:*`` near-duplicate index (LSH buckets, ``services/common/cache/neardup_index.py``).
* ``ocr:req:<id>``     requests accepted over HTTP and not yet completed (the HTTP door).

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

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from schemas.keys import CacheGeneration
from services.common.errors import OcrstreamError
from services.common.settings import RedisSettings
from services.common.telemetry import Telemetry

# KEYS: entry, accepted-marker   ARGV: marker value, marker ttl s
_GET_AND_MARK = """
local hit = redis.call('GET', KEYS[1])
if hit and ARGV[1] ~= '' then redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2]) end
return hit
"""


class CacheUnavailable(OcrstreamError):
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


class ResultCache:
    """The Redis result cache (see the module docstring).

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
        self._get_and_mark = self.client.register_script(_GET_AND_MARK)

    def entry_key(self, key: str) -> str:
        """The Redis key of ``key``'s cache entry (``<prefix>:c:<key>``)."""
        return f"{self.p}:c:{key}"

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

    async def ping(self) -> bool:
        """True if Redis answers within the time budget."""
        try:
            return bool(await self._call("ping", self.client.ping()))
        except CacheUnavailable:
            return False

    async def get(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` or None. Raises :class:`CacheUnavailable`."""
        raw = await self._call("get", self.client.get(self.entry_key(key)))
        return CacheEntry.from_json(raw) if raw else None

    async def get_with_ttl(self, key: str) -> tuple[CacheEntry | None, int | None]:
        """The entry for ``key`` (or None) and its remaining time to live in ms (None: no expiry or
        no entry), in one round trip. Raises :class:`CacheUnavailable`."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.entry_key(key))
        pipe.pttl(self.entry_key(key))
        raw, ttl = await self._call("get", pipe.execute())
        if not raw:
            return None, None
        return CacheEntry.from_json(raw), (int(ttl) if ttl is not None and int(ttl) >= 0 else None)

    async def put(self, key: str, entry: CacheEntry, ttl_s: int) -> None:
        """Store ``entry`` for ``key`` for ``ttl_s`` seconds (overwrites). Raises :class:`CacheUnavailable`."""
        await self._call("set", self.client.set(self.entry_key(key), entry.to_json(), px=ttl_s * 1000))

    async def delete(self, key: str) -> None:
        """Remove ``key``'s entry (its document is gone). Raises :class:`CacheUnavailable`."""
        await self._call("delete", self.client.delete(self.entry_key(key)))

    async def register_generation(self, gen: CacheGeneration) -> None:
        """Record a generation so ``purge`` can find its entries by model revision."""
        await self._call("hset", self.client.hset(f"{self.p}:gens", gen.gen_id, gen.model_dump_json()))

    async def generations(self) -> dict[str, CacheGeneration]:
        """Every generation registered in ``ocr:gens`` (by dedup), by id.

        Raises:
            RedisError: Redis down, refusing, or slower than the client's socket timeout.
        """
        gens = await self.client.hgetall(f"{self.p}:gens")
        return {gid.decode(): CacheGeneration.model_validate_json(raw) for gid, raw in gens.items()}

    async def purge(self, *, model_revision: str | None = None, gen_id: str | None = None) -> tuple[list[str], int]:
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
            ``(ids of the generations matched, entries deleted)``.

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
        return targets, deleted

    # -- requests accepted over HTTP, not yet completed ----------------------------------------
    async def mark_accepted(self, request_id: str, value: bytes, ttl_s: int) -> None:
        """Remember an accepted request (``<prefix>:req:<id>`` = ``value``, expiring after ``ttl_s``)
        so ``GET /v1/ocr/{id}`` can tell "pending" from "unknown". Raises :class:`CacheUnavailable`."""
        await self._call("set", self.client.set(f"{self.p}:req:{request_id}", value, ex=ttl_s))

    async def accepted(self, request_id: str) -> bytes | None:
        """The value stored by :meth:`mark_accepted`, or None. Raises :class:`CacheUnavailable`."""
        return await self._call("get", self.client.get(f"{self.p}:req:{request_id}"))

    async def accepted_many(self, request_ids: list[str]) -> list[bytes | None]:
        """:meth:`accepted` of each id, in order, in one ``MGET`` (one round trip, one connection).
        Raises :class:`CacheUnavailable`."""
        if not request_ids:
            return []
        return await self._call("mget", self.client.mget([f"{self.p}:req:{rid}" for rid in request_ids]))

    async def get_and_mark(self, key: str, request_id: str, value: bytes, ttl_s: int) -> CacheEntry | None:
        """The entry for ``key`` or None, and on a hit also :meth:`mark_accepted` for
        ``request_id`` (``value`` empty: no marker), in one round trip (the HTTP door's cached
        path). Raises :class:`CacheUnavailable`."""
        raw = await self._call("get_and_mark", self._get_and_mark(
            keys=[self.entry_key(key), f"{self.p}:req:{request_id}"], args=[value, ttl_s]))
        return CacheEntry.from_json(raw) if raw else None
