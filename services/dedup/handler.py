"""Dedup logic: cache lookup (LRU, then Redis) and single flight per cache key."""

from __future__ import annotations

import logging
import time

from aiokafka import ConsumerRecord

from schemas.errors import ErrorCode
from schemas.events import ErrorInfo, InferEvent, Page, RequestEvent, ResultEvent
from services.common.cache import PROMOTED_MAX_SENDS, CacheEntry, CacheUnavailable, Promotion, ResultCache
from services.common.dlq import poison_messages
from services.common.events import dumps, loads, queue_wait_ms
from services.common.kafka import Outgoing
from services.common.runner import Handler
from services.common.telemetry import SpanKind, Telemetry, record_attrs
from services.dedup.backlog import BacklogUnknown, DownstreamBacklog
from services.dedup.lru import EntryLru
from services.dedup.near import NearDupLookup, NearHit
from services.dedup.settings import DedupSettings

log = logging.getLogger(__name__)

GEN_REREGISTER_S = 300.0
"""Seconds between re-registrations of a generation in ``ocr:gens`` (one HSET): its record comes
back within this if it was lost (Redis without persistence restarted, a purge by an older CLI
that deleted it), so ``cache purge`` finds the entries made since."""


class DedupHandler(Handler):
    """For each request: hit -> ``ocr.results`` (cache_hit, no model call); miss -> claim the
    in-flight lease and go to ``ocr.infer``; lease already held -> join the waiters, completed
    by the sink together with the holder. Redis down -> a plain miss (no lease, no waiting).

    Records are handled one after another, so copies of one image in one batch (same key, same
    partition) find the lease taken by the first.

    With ``near_dup`` on (``near`` given), a request that took the lease is first looked up by
    perceptual hash; a verified near duplicate goes to ``ocr.results`` as a hit carrying the
    other image's lines rescaled to this one (the sink stores it under this image's key and
    completes any waiters), otherwise the request goes to inference as usual.
    """

    def __init__(self, settings: DedupSettings, cache: ResultCache, telemetry: Telemetry,
                 near: NearDupLookup | None = None, backlog: DownstreamBacklog | None = None):
        """
        Args:
            settings: The dedup settings.
            cache: The Redis cache (claims, leases, the reaper's promotions).
            telemetry: Spans and the ``ocrstream_cache_total`` counters.
            near: The near-duplicate lookup, or None (off).
            backlog: What the reaper asks before it replaces a holder whose deadline passed;
                None replaces such a holder at once (unit tests; the stage always passes one).
        """
        self.s = settings
        self.cache = cache
        self.telemetry = telemetry
        self.near = near
        self.backlog = backlog
        self._marks: dict[str, list] = {}  # expired held key -> [topic, partition, offset the group must commit past]
        self._gave_up: list[str] = []  # request ids whose give-up results the last on_idle returned
        self._answered: dict[str, list[bytes]] = {}  # key -> waiters the last on_idle answered from its entry
        self.lru = EntryLru(settings.lru_entries, settings.lru_bytes, settings.lru_ttl_s)
        self._known_gens: dict[str, float] = {}  # gen_id -> when registered (monotonic s)

    async def handle(self, records: list[ConsumerRecord]) -> list[Outgoing]:
        """See :meth:`Handler.handle`."""
        out: list[Outgoing] = []
        for record in records:
            req = loads(RequestEvent, record.value)
            queued = queue_wait_ms(record)
            with self.telemetry.span("dedup", parent_headers=record.headers, kind=SpanKind.CONSUMER,
                                     attributes=record_attrs(record)):
                msgs = await self._one(req, queued, self.telemetry.inject(record.headers))
                log.info("dedup: %s[%d]@%d request %s -> %s", record.topic, record.partition, record.offset,
                         req.request_id, ", ".join(m.topic for m in msgs) or "joined the in-flight request")
            out.extend(msgs)
        return out

    async def _one(self, req: RequestEvent, queued: float, headers) -> list[Outgoing]:
        started = time.perf_counter()

        def timed(r: RequestEvent) -> RequestEvent:
            t = dict(r.timings_ms, queue_dedup=queued, dedup=(time.perf_counter() - started) * 1000)
            return r.model_copy(update={"timings_ms": t})

        if (refused := self.s.task_error(req.task)) is not None:
            # ingest refuses these first; one can still arrive from an ingest or door with other
            # settings (a rolling upgrade): refused here too, before any generation or Redis call
            self.telemetry.requests_done.labels("dedup", "error", ErrorCode.INVALID_REQUEST.value).inc()
            ev = ResultEvent(request=timed(req), status="error",
                             error=ErrorInfo(code=ErrorCode.INVALID_REQUEST, message=refused))
            return [Outgoing(self.s.topics.results, req.content_sha256, dumps(ev), headers)]
        gen = self.s.generation(req.task)
        key = self.s.cache_key_of(req.content_sha256, gen, req.api_key_id)

        def near_hit(n: NearHit) -> list[Outgoing]:
            self.telemetry.cache.labels("dedup", "hit", "near").inc()
            ev = ResultEvent(request=timed(req), cache_key=key, cache_hit=True, status="ok", engine=gen.engine,
                             model=gen.model, model_revision=gen.model_revision,
                             pages=[Page(index=1, width=n.width, height=n.height)], lines=n.lines,
                             near_duplicate_of=n.of_sha256, warnings=n.output.warnings)
            return [Outgoing(self.s.topics.results, req.content_sha256, dumps(ev), headers)]

        def hit(entry: CacheEntry, tier: str) -> list[Outgoing]:
            self.telemetry.cache.labels("dedup", "hit", tier).inc()
            return [self._hit(timed(req), key, entry, headers)]

        def to_infer() -> list[Outgoing]:
            ev = InferEvent(request=timed(req), cache_key=key)
            return [Outgoing(self.s.topics.infer, req.content_sha256, dumps(ev), headers)]

        if not self.s.cache_enabled:
            self.telemetry.cache.labels("dedup", "miss", "disabled").inc()
            return to_infer()
        entry = self.lru.get(key)
        if entry is not None:
            return hit(entry, "lru")
        try:
            now = time.monotonic()
            if now - self._known_gens.get(gen.gen_id, -GEN_REREGISTER_S) >= GEN_REREGISTER_S:
                await self.cache.register_generation(gen)
                self._known_gens[gen.gen_id] = now
            claim = await self.cache.claim(key, req.request_id, dumps(timed(req)), self.s.lease_ms)
        except CacheUnavailable as exc:
            log.warning("dedup: Redis unavailable (%s); %s goes to inference without a lease", exc, req.request_id)
            self.telemetry.cache.labels("dedup", "miss", "no-redis").inc()
            return to_infer()
        if claim.outcome == "hit":
            self.lru.put(key, claim.entry, None if claim.ttl_ms is None else claim.ttl_ms / 1000)
            return hit(claim.entry, "redis")
        if claim.outcome == "lead":
            found = await self._near(req, gen) if self.near is not None else None
            if found is not None:
                return near_hit(found)
            self.telemetry.cache.labels("dedup", "miss", "redis").inc()
            return to_infer()
        self.telemetry.cache.labels("dedup", "joined", "redis").inc()
        return []

    async def _near(self, req: RequestEvent, gen) -> NearHit | None:
        """The verified near duplicate of ``req``'s image, or None. Never raises: any trouble
        (Redis, S3, an undecodable image) makes it a plain miss, and inference decides."""
        if req.image_uri is None or req.size_bytes > self.s.near_dup.max_image_bytes:
            return None
        with self.telemetry.span("dedup.near_dup"):
            try:
                found = await self.near.find(req.content_sha256, req.image_uri, req.frames, gen,
                                             self.s.cache_scope_of(req.api_key_id))
            except Exception as exc:  # noqa: BLE001 - near duplicates are an optimisation only
                self.telemetry.cache.labels("dedup", "error", "near").inc()
                log.warning("dedup: near-duplicate lookup of %s failed (%r); plain miss", req.request_id, exc)
                return None
        if found is not None:
            log.info("dedup: request %s is a near duplicate of %s (%d bits, worst window %.2f)", req.request_id,
                     found.of_sha256, found.distance, found.verdict.worst_block)
        return found

    async def on_idle(self) -> list[Outgoing]:
        """Reaper (about once a second): settle each key whose lease deadline has passed
        (:meth:`_reap`), then end the promoted waiters given up after
        :data:`~services.common.cache.PROMOTED_MAX_SENDS` sends with ``internal_error``
        (:meth:`_give_up`). What it returns is acknowledged by Kafka before :meth:`after_produce`
        removes it from Redis; if it fails half-way, nothing is removed."""
        self._gave_up, self._answered = [], {}
        try:
            out = await self._reap()
            out.extend(await self._give_up())
        except BaseException:
            self._gave_up, self._answered = [], {}
            raise
        return out

    async def _give_up(self) -> list[Outgoing]:
        """An ``internal_error`` result for each waiter in :meth:`ResultCache.given_up`.

        They stay in Redis until :meth:`after_produce` (these results acknowledged by Kafka), so a
        lost reply of the promotion that gave one up, or this process dying before its result is
        produced, does not forget it: the next reaper pass, here or in another dedup, ends it.
        Two reapers may both end one; the sink keeps a request's first final state.
        """
        try:
            found = await self.cache.given_up()
        except CacheUnavailable:
            return []
        out: list[Outgoing] = []
        for raw in found:
            req = RequestEvent.model_validate_json(raw)
            ev = ResultEvent(request=req, status="error", error=ErrorInfo(
                code=ErrorCode.INTERNAL_ERROR,
                message=f"sent to inference {PROMOTED_MAX_SENDS} times and no result came back"))
            out.append(Outgoing(self.s.topics.results, req.content_sha256, dumps(ev), self.telemetry.inject()))
            self._gave_up.append(req.request_id)
        return out

    async def after_produce(self) -> None:
        """The reaper's results were just acknowledged: forget the given-up waiters
        (:meth:`_give_up`) and remove the waiters answered from a cached entry (:meth:`_settled`)."""
        done, self._gave_up = self._gave_up, []
        answered, self._answered = self._answered, {}
        try:
            if done:
                await self.cache.forget_given_up(done)
            for key, waiters in answered.items():
                await self.cache.remove_waiters(key, waiters)
        except CacheUnavailable:
            log.warning("dedup: could not remove %d given-up and %d answered waiters in Redis; they are answered again",
                        len(done), sum(map(len, answered.values())))

    async def _reap(self) -> list[Outgoing]:
        """Settle each key whose lease deadline has passed.

        * Nobody holds the lease (it was released with waiters left, or its backstop expiry ran
          out): the first waiter is promoted and re-sent to inference.
        * The holder may still be on its way: the infer group has not yet committed past the end
          offset its key's ``ocr.infer`` partition had when the deadline first passed, or the
          sink group past the end offset of its ``ocr.results`` partition taken after that (see
          :mod:`services.dedup.backlog`), or Kafka cannot tell. The deadline moves ``lease_ms``
          on, so a backlog or a stopped infer never turns copies of one image into several
          inferences, and steady traffic does not hold a lost holder's waiters back.
        * Otherwise the holder's result was handled but the key never completed (a lost
          completion): the first waiter is promoted and re-sent.

        If a result is cached by then, its holder stored it and the sink completed the waiters
        with it; only the stale lease and its in-flight mark are removed (:meth:`ResultCache.promote`).

        A holder that was itself a promoted waiter may never have been sent (the promotion's
        Redis reply was lost, or the process that promoted it died before producing its event):
        it is sent again rather than passed over (a result cached meanwhile completes it as a
        waiter, :meth:`ResultCache.complete_begin`). A duplicate send costs at most one
        inference; the sink keeps the first final state of a request and re-emits that.
        """
        if not self.s.cache_enabled:
            return []
        out: list[Outgoing] = []
        try:
            held: list[str] = []
            for key in await self.cache.expired_leases():
                p = await self.cache.promote(key, self.s.lease_ms, unheld_only=True)
                if p.outcome == "held":
                    held.append(key)
                else:
                    out.extend(self._settled(key, p, "its lease was released with waiters left"))
            for gone in set(self._marks) - set(held):
                del self._marks[gone]  # completed, promoted or renewed elsewhere meanwhile
            if not held:
                return out
            offsets = None
            if self.backlog is not None:
                try:
                    offsets = await self.backlog.offsets()
                except BacklogUnknown as exc:
                    log.warning("dedup: cannot read the backlog after dedup (%s); %d expired leases kept", exc, len(held))
            for key in held:
                if self.backlog is not None and (offsets is None or self._maybe_on_its_way(key, offsets)):
                    if await self.cache.extend(key, self.s.lease_ms):
                        self.telemetry.cache.labels("dedup", "extended", "redis").inc()
                    continue
                self._marks.pop(key, None)
                p = await self.cache.promote(key, self.s.lease_ms)
                out.extend(self._settled(key, p, "its holder's result was handled but never completed the key"))
        except CacheUnavailable:
            pass
        return out

    def _maybe_on_its_way(self, key: str, offsets: dict[str, tuple[dict[int, int], dict[int, int]]]) -> bool:
        """Advance ``key``'s mark (see :mod:`services.dedup.backlog`); True while the holder's event
        or result may still be uncommitted in ``ocr.infer`` or ``ocr.results``."""
        sha = key.rsplit(":", 1)[-1].encode()
        infer_t, results_t = self.s.topics.infer, self.s.topics.results
        mark = self._marks.get(key)
        if mark is None:
            p = self.backlog.partition(infer_t, sha)
            mark = self._marks[key] = [infer_t, p, offsets[infer_t][0][p]]
        if mark[0] == infer_t and offsets[infer_t][1][mark[1]] >= mark[2]:
            p = self.backlog.partition(results_t, sha)
            mark[:] = [results_t, p, offsets[results_t][0][p]]
        return not (mark[0] == results_t and offsets[results_t][1][mark[1]] >= mark[2])

    def _hit(self, req: RequestEvent, key: str, entry: CacheEntry, headers) -> Outgoing:
        """``req`` answered from the cache entry ``entry`` of ``key``: a cache-hit result for the sink."""
        gen = self.s.generation(req.task)
        ev = ResultEvent(request=req, cache_key=key, cache_hit=True, status="ok", result_uri=entry.result_uri,
                         engine=gen.engine, model=gen.model, model_revision=gen.model_revision)
        return Outgoing(self.s.topics.results, req.content_sha256, dumps(ev), headers)

    def _settled(self, key: str, p: Promotion, why: str) -> list[Outgoing]:
        """What to send for a :meth:`ResultCache.promote` outcome of the reaper's: the promoted or
        re-sent waiter to ``ocr.infer``, or a cache hit for each waiter left on a key whose result
        is cached. A waiter given up is ended by :meth:`_give_up`."""
        out: list[Outgoing] = []
        if p.outcome == "hit" and p.waiters:
            # The result is cached but these waiters were never completed (the sink that began
            # completing them died with them deferred, or is stuck on a long outage): answered
            # here like any cache hit; the sink keeps each request's first final state.
            entry = CacheEntry.from_json(p.raw)
            log.warning("dedup: %s is cached but %d waiting request(s) were never completed; answering them from "
                        "the cache", key, len(p.waiters))
            self.telemetry.cache.labels("dedup", "waiters_answered", "redis").inc(len(p.waiters))
            out.extend(self._hit(RequestEvent.model_validate_json(raw), key, entry, self.telemetry.inject())
                       for raw in p.waiters)
            self._answered[key] = list(p.waiters)
        if p.abandoned is not None:
            req = RequestEvent.model_validate_json(p.abandoned)
            self.telemetry.cache.labels("dedup", "abandoned", "redis").inc()
            log.error("dedup: request %s was sent to inference %d times as the holder of %s and no result came "
                      "back; ending it with internal_error", req.request_id, PROMOTED_MAX_SENDS, key)
        if p.raw is None or p.outcome not in ("promoted", "resent"):
            return out
        req = RequestEvent.model_validate_json(p.raw)
        self.telemetry.cache.labels("dedup", p.outcome, "redis").inc()
        with self.telemetry.span("dedup.promote", traceparent=req.traceparent, root=True):  # the waiter's trace
            if p.outcome == "resent":
                log.warning("dedup: request %s was promoted on %s but never finished; sending it again",
                            req.request_id, key)
            else:
                log.warning("dedup: lease on %s expired and %s; promoting waiting request %s", key, why, req.request_id)
            ev = InferEvent(request=req, cache_key=key, attempt=p.attempt)
            out.append(Outgoing(self.s.topics.infer, req.content_sha256, dumps(ev), self.telemetry.inject()))
        return out

    def poison(self, record: ConsumerRecord, exc: BaseException, attempts: int) -> list[Outgoing]:
        """DLQ the record and fail its request."""
        return poison_messages(stage="dedup", topics=self.s.topics, record=record, exc=exc, attempts=attempts)

    async def close(self) -> None:
        """Close the Redis pool and the backlog's Kafka clients."""
        await self.cache.close()
        if self.backlog is not None:
            await self.backlog.close()
        if self.near is not None:
            await self.near.close()
