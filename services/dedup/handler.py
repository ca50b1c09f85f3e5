"""Dedup logic: answer repeats from the cache tiers, and compute each cache key once (single flight
as keyed state, :mod:`services.dedup.state`)."""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from schemas.errors import ErrorCode
from schemas.events import InferEvent, RequestEvent, RequestLogEvent, ResultEvent, SettledEvent, now_ms
from schemas.keys import purge_fence_key, result_object_key, split_cache_key
from schemas.reading import ErrorInfo, Page
from schemas.tasks import TASKS, TaskError
from services.common.cache.entries import CacheUnavailable, ResultCache
from services.common.dlq import oversized_result, poison_messages
from services.common.codec import dumps
from services.common.cache.field_index import find_extractions
from services.common.handler import Handler, Outgoing, Record, TopicPartition
from services.common.results.build import cache_hit_event
from services.common.s3 import ObjectStore
from services.common.telemetry import Telemetry
from services.dedup.changelog import Changelog
from services.common.cache.lru import EntryLru
from services.dedup.near import NearDupLookup, NearHit
from services.dedup.settings import DedupSettings
from services.dedup.state import PartitionState, Settled, Settlement

log = logging.getLogger(__name__)

GEN_REREGISTER_S = 300.0
"""Seconds between re-registrations of a generation in ``ocr:gens`` (one HSET): its record comes
back within this if it was lost (Redis flushed or restarted empty), so ``cache purge`` finds the
entries made since."""


FENCE_READ_S = 2.0
"""Time budget of one read of a purge fence, s (once per generation every ``fence_refresh_s``; the
first S3 call of a fresh process may take a second on a loaded machine)."""


def _is_settlement(record: Record) -> bool:
    """Whether a record of ``ocr.requests`` is a settlement: decoded as one, or, undecodable, its
    JSON names ``ocr.settled.v1`` as its schema (or names none and has a ``cache_key``, as
    :class:`~schemas.events.RequestLogEvent` reads it)."""
    value = record.value.root if isinstance(record.value, RequestLogEvent) else record.value
    if isinstance(value, SettledEvent):
        return True
    try:
        v = orjson.loads(record.raw)
        return v.get("schema") == "ocr.settled.v1" or (not v.get("schema") and "cache_key" in v)
    except Exception:  # noqa: BLE001 - not JSON, or not an object: not a settlement we can end
        return False


class DedupHandler(Handler):
    """Reads ``ocr.requests``: the requests of each cache key and, from the sink, its settlement, in
    one log per key (its content SHA-256's partition), so dedup sees them in the order they were
    produced (:class:`~schemas.events.RequestLogEvent`).

    A request, after the task check:

    1. its request id already in flight here: nothing (a replay);
    2. its key settled a moment ago (the state's window): a hit, tier ``settled``;
    3. its key in flight: it joins the waiters (no output); past ``max_waiters`` held in memory it
       waits in the changelog only (spilled) and is read back when the key settles: never
       computed again;
    4. the LRU (L1), Redis (L2), the stored result document in S3 (L3, one HEAD within
       ``s3_tier_timeout_ms``, fenced by ``cache purge``): a hit with that tier;
       ``extract`` only: an extraction of the image holding every field asked (tier ``fields``,
       :meth:`_fields`), its key and document, the sink answering only the fields asked;
    5. with near duplicates on, a verified look-alike: a hit (its result is stored under this key
       by the sink, which settles the key);
    6. otherwise it becomes the key's holder and goes to inference: ``ocr.infer-interactive`` for an
       interactive request, ``ocr.infer`` for a bulk one.

    A settlement completes the key's waiters with the holder's result (hits, tier
    ``single_flight``, carrying the stored document's S3 pointer), promotes one after a retryable
    failure, or shares a final error (:meth:`PartitionState.settle`). State changes go to the
    changelog after the batch's messages are acknowledged, before its offsets are committed
    (:meth:`after_produce`).

    Args:
        settings: The dedup settings.
        cache: Redis (entries, generations, the near-duplicate index): never needed for correctness.
        telemetry: Spans, ``ocrstream_cache_total`` and the state gauges.
        store: S3, for the third tier and purge fences; None turns both off (unit tests).
        changelog: Where the state is backed up; None keeps it in memory only (unit tests).
        near: The near-duplicate lookup, or None (off).
    """

    def __init__(self, settings: DedupSettings, cache: ResultCache, telemetry: Telemetry,
                 store: ObjectStore | None = None, changelog: Changelog | None = None,
                 near: NearDupLookup | None = None):
        self.s = settings
        self.cache = cache
        self.telemetry = telemetry
        self.store = store
        self.changelog = changelog
        self.near = near
        self.states: dict[int, PartitionState] = {}
        self.lru = EntryLru(settings.lru_entries, settings.lru_bytes, settings.lru_ttl_s)
        self._known_gens: dict[str, float] = {}  # gen_id -> when registered (monotonic s)
        self._fences: dict[str, tuple[float, int]] = {}  # gen_id -> (read at, monotonic s; purged_at_ms, 0 = none)
        self._to_index: list[tuple[str, str, int]] = []  # (space, sha, hash) whose indexing failed: retried on idle
        self._revoked: set[int] = set()  # partition numbers revoked and not assigned back: never restored by handle

    # -- partitions -------------------------------------------------------------------------
    def _new_state(self, p: int) -> PartitionState:
        return PartitionState(p, max_waiters=self.s.max_waiters, settled_window_ms=int(self.s.settled_window_s * 1000),
                              settled_max_keys=self.s.settled_max_keys, max_attempts=self.s.max_attempts)

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """Restore the state of each newly assigned partition number from the changelog, afresh: a
        state this process still holds for one of them predates its last owner's changes."""
        ps = sorted({tp.partition for tp in assigned})
        self._revoked.difference_update(ps)
        for p in ps:
            self.states.pop(p, None)
        await self._ensure(ps)

    async def _ensure(self, partitions: list[int]) -> None:
        new = [p for p in partitions if p not in self.states]
        if not new:
            return
        started = time.perf_counter()
        records = await self.changelog.restore(new) if self.changelog is not None else {p: {} for p in new}
        totals = [0, 0, 0]
        for p in new:
            st = self._new_state(p)
            for i, n in enumerate(st.restore(records[p])):
                totals[i] += n
            self.states[p] = st
        for kind, n in zip(("in_flight", "waiters", "settled"), totals):
            self.telemetry.state_restored.labels(kind).inc(n)
        log.info("dedup: restored partitions %s from the changelog in %.0f ms: %d keys in flight, %d waiting "
                 "copies, %d settled keys", new, (time.perf_counter() - started) * 1000, *totals)
        self._gauge()

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Drop the state of the revoked partition numbers (its next owner restores it)."""
        for p in sorted({tp.partition for tp in revoked}):
            self._revoked.add(p)
            st = self.states.pop(p, None)
            if st is not None and st.pending:
                log.warning("dedup: partition %d revoked with %d changelog records unwritten", p, len(st.pending))
        self._gauge()

    def _gauge(self) -> None:
        states = list(self.states.values())
        self.telemetry.state_size.labels("in_flight").set(sum(len(s.inflight) for s in states))
        self.telemetry.state_size.labels("waiters").set(sum(len(f.waiters) + f.spilled for s in states
                                                             for f in s.inflight.values()))
        self.telemetry.state_size.labels("settled").set(sum(len(s.settled) for s in states))

    # -- records ----------------------------------------------------------------------------
    def consumes(self) -> dict[str, type[RequestLogEvent]]:
        """``ocr.requests`` -> :class:`~schemas.events.RequestLogEvent` (a request or a settlement;
        see :meth:`Handler.consumes`; a value that does not decode fails like one that raises)."""
        return {self.s.topics.requests: RequestLogEvent}

    async def handle(self, records: list[Record]) -> list[Outgoing]:
        """See :meth:`Handler.handle`. A call that raises leaves the state as it was. A record of a
        partition revoked meanwhile (a revocation whose drain timed out) is skipped: the runner does
        not commit it and the partition's next owner handles it with the state it restored."""
        await self._ensure(sorted({r.partition for r in records} - self._revoked))
        live = dict(self.states)  # a partition revoked (and maybe restored afresh) meanwhile is not this batch's
        out: list[Outgoing] = []
        try:
            for record in records:
                if (st := live.get(record.partition)) is None or self.states.get(record.partition) is not st:
                    log.warning("dedup: %s[%d]@%d skipped: its partition was revoked during the batch",
                                record.topic, record.partition, record.offset)
                    continue
                with record.traced():
                    headers = record.trace_headers()
                    ev = record.value.root if isinstance(record.value, RequestLogEvent) else record.value
                    if isinstance(ev, SettledEvent):
                        msgs = await self._settled(record, ev)
                    else:
                        msgs = await self._request(record, ev, headers)
                out.extend(msgs)
        except BaseException:
            for st in self.states.values():
                st.rollback()
            raise
        for st in self.states.values():
            st.keep()
        self._gauge()
        return out

    async def _request(self, record: Record, req: RequestEvent, headers) -> list[Outgoing]:
        started = time.perf_counter()
        queued = record.queue_wait_ms()

        def timed(r: RequestEvent) -> RequestEvent:
            t = dict(r.timings_ms, queue_dedup=queued, dedup=(time.perf_counter() - started) * 1000)
            return r.model_copy(update={"timings_ms": t})

        msgs, how = await self._decide(record, req, timed, headers)
        log.info("dedup: %s[%d]@%d request %s -> %s", record.topic, record.partition, record.offset,
                 req.request_id, how)
        return msgs

    async def _decide(self, record: Record, req: RequestEvent, timed, headers) -> tuple[list[Outgoing], str]:
        """The messages for one request and a few words for the log line."""
        try:
            params = self.s.check_task(req.task, req.task_params)
        except TaskError as exc:
            # ingest refuses these first; one can still arrive from an ingest or door with other
            # settings (a rolling upgrade): refused here too, before any generation or Redis call
            self.telemetry.requests_done.labels("dedup", "error", ErrorCode.INVALID_REQUEST.value).inc()
            ev = ResultEvent(request=timed(req), status="error",
                             error=ErrorInfo(code=ErrorCode.INVALID_REQUEST, message=str(exc)))
            return [self._out(self.s.topics.results, req, ev, headers)], "refused (task)"
        if params != req.task_params:  # normalised as the door does (a door of another version)
            req = req.model_copy(update={"task_params": params})
        gen = self.s.generation(req.task, params)
        key = self.s.cache_key_of(req.content_sha256, gen, req.api_key_id)
        if not self.s.cache_enabled:
            self.telemetry.cache.labels("dedup", "miss", "disabled").inc()
            return [self._infer(timed(req), key, 1, headers)], "ocr.infer (cache off)"
        st = self.states[record.partition]
        fence = await self._fence(gen.gen_id)
        found = st.lookup(key, req.request_id, now_ms())
        if found.kind == "settled" and found.settled.at_ms <= fence:
            st.forget_settled(key)  # purged since: as if never settled
            found = st.lookup(key, req.request_id, now_ms())
        if found.kind == "replay":
            return [], "already in flight (replay)"
        if found.kind == "settled":
            return [self._hit(timed(req), key, found.settled, "settled", headers)], "hit (settled)"
        if found.kind == "joinable":
            self.telemetry.cache.labels("dedup", "joined", "state").inc()
            st.join(key, record.offset, timed(req))
            return [], "joined the copy in flight"
        if found.kind == "spill":
            self.telemetry.cache.labels("dedup", "joined", "changelog").inc()
            st.spill(key, record.offset, timed(req))
            return [], f"joined the copy in flight (in the changelog: over {self.s.max_waiters} waiting)"
        hit = await self._cached(key, gen, fence)
        if hit is not None:
            settled, tier = hit
            return [self._hit(timed(req), key, settled, tier, headers)], f"hit ({tier})"
        if params is not None and params.fields is not None and (sup := await self._fields(key, gen, params.fields)):
            of_key, settled = sup  # an extraction holding every field asked: answered from its document
            return [self._hit(timed(req), of_key, settled, "fields", headers)], f"hit (fields of {of_key})"
        near_hash, space = None, None
        if self.near is not None and TASKS[req.task].slot == "lines":  # a look-alike's lines, boxes rescaled
            found_near, near_hash, space = await self._near(req, gen)
            if found_near is not None:
                st.lead(key, timed(req))  # its result settles the key like a computed one
                return [self._near_hit(timed(req), key, gen, found_near, headers)], "near-duplicate hit"
        self.telemetry.cache.labels("dedup", "miss", "all").inc()
        st.lead(key, timed(req), near_hash, space)
        return [self._infer(timed(req), key, 1, headers)], "ocr.infer (holder)"

    async def _cached(self, key: str, gen, fence: int) -> tuple[Settled, str] | None:
        """The key's stored result from L1, L2 or L3, with the tier's name; None on a miss everywhere."""
        entry = self.lru.get(key)
        if entry is not None and entry.created_at_ms > fence:
            return Settled(entry.result_uri, entry.created_at_ms), "lru"
        try:
            now = time.monotonic()
            if now - self._known_gens.get(gen.gen_id, -GEN_REREGISTER_S) >= GEN_REREGISTER_S:
                await self.cache.register_generation(gen)
                self._known_gens[gen.gen_id] = now
            entry, ttl_ms = await self.cache.get_with_ttl(key)
        except CacheUnavailable as exc:
            self.telemetry.cache.labels("dedup", "error", "redis").inc()
            log.debug("dedup: Redis unavailable (%s)", exc)
            entry, ttl_ms = None, None
        if entry is not None and entry.created_at_ms > fence:  # an entry a purge missed (Redis down) is fenced too
            self.lru.put(key, entry, None if ttl_ms is None else ttl_ms / 1000)
            return Settled(entry.result_uri, entry.created_at_ms), "redis"
        uri = await self._s3_tier(key, fence)
        return (Settled(uri, now_ms()), "s3") if uri is not None else None

    async def _fields(self, key: str, gen, fields: tuple[str, ...]) -> tuple[str, Settled] | None:
        """An ``extract`` miss answered from another extraction of the image: the key and stored
        document of the smallest one of the same family and scope whose fields include every one of
        ``fields`` (:func:`services.common.cache.field_index.find_extractions`, one LIST and a few GETs
        within ``s3_tier_timeout_ms``), unless its generation's purge fence is newer (one HEAD, as
        the S3 tier); None when there is none or on any trouble (a miss)."""
        if self.store is None:
            return None
        try:
            async with asyncio.timeout(self.s.s3_tier_timeout_ms / 1000):
                found = await find_extractions(self.store, key, gen, fields)
        except Exception as exc:  # noqa: BLE001 - an optimisation: a miss
            self.telemetry.cache.labels("dedup", "error", "fields").inc()
            log.info("dedup: field index lookup for %s failed (%r); a miss", key, exc)
            return None
        for of_key in found[:3]:
            uri = await self._s3_tier(of_key, await self._fence(split_cache_key(of_key)[0]))
            if uri is not None:
                return of_key, Settled(uri, now_ms())
        return None

    async def _s3_tier(self, key: str, fence: int) -> str | None:
        """The key's stored result document in S3 (one HEAD within ``s3_tier_timeout_ms``), unless
        it was written before the generation's purge fence; None on a miss, a fence or any trouble."""
        if self.store is None:
            return None
        okey = result_object_key(key)
        try:
            async with asyncio.timeout(self.s.s3_tier_timeout_ms / 1000):
                modified = await self.store.last_modified_ms(okey)
        except Exception as exc:  # noqa: BLE001 - the third tier is an optimisation: a miss
            self.telemetry.cache.labels("dedup", "error", "s3").inc()
            log.info("dedup: S3 tier lookup of %s failed (%r); a miss", okey, exc)
            return None
        if modified is None or modified <= fence:
            return None
        return self.store.uri(okey)

    async def resolve(self, key: str) -> str | None:
        """A key's stored result document for the near-duplicate lookup: the settled window if this
        process has it, else the S3 tier (fenced)."""
        gen_id, _ = split_cache_key(key)
        fence = await self._fence(gen_id)
        for st in self.states.values():
            s = st.settled.get(key)
            if s is not None and s.at_ms > fence:
                return s.result_uri
        return await self._s3_tier(key, fence)

    async def _fence(self, gen_id: str) -> int:
        """The generation's purge fence (epoch ms; 0 = never purged), read from S3 at most every
        ``fence_refresh_s`` (within :data:`FENCE_READ_S`); a failed read keeps the last value and is
        tried again a second later."""
        if self.store is None:
            return 0
        now = time.monotonic()
        read_at, fence = self._fences.get(gen_id, (-1e18, 0))
        if now - read_at < self.s.fence_refresh_s:
            return fence
        try:
            async with asyncio.timeout(FENCE_READ_S):
                raw = await self.store.get(purge_fence_key(gen_id))
            fence = int(orjson.loads(raw)["purged_at_ms"])
        except Exception as exc:  # noqa: BLE001 - none yet (the usual case) or unreadable: keep the last
            if getattr(exc, "code", None) != ErrorCode.MISSING_OBJECT:
                log.warning("dedup: purge fence of %s unreadable (%r); trying again in a second", gen_id, exc)
                self._fences[gen_id] = (now - self.s.fence_refresh_s + 1.0, fence)  # not on every request
                return fence
        self._fences[gen_id] = (now, fence)
        return fence

    async def _near(self, req: RequestEvent, gen) -> tuple[NearHit | None, int | None, str | None]:
        """The verified near duplicate of ``req``'s image (or None) and its hash for indexing. Never
        raises: any trouble (Redis, S3, an undecodable image) makes it a plain miss."""
        if req.image_uri is None or req.size_bytes > self.s.near_dup.max_image_bytes:
            return None, None, None
        with self.telemetry.span("dedup.near_dup"):
            try:
                found, h, space = await self.near.find(req.content_sha256, req.image_uri, req.frames, gen,
                                                       self.s.cache_scope_of(req.api_key_id))
            except Exception as exc:  # noqa: BLE001 - near duplicates are an optimisation only
                self.telemetry.cache.labels("dedup", "error", "near").inc()
                log.warning("dedup: near-duplicate lookup of %s failed (%r); plain miss", req.request_id, exc)
                return None, None, None
        if found is not None:
            log.info("dedup: request %s is a near duplicate of %s (%d bits, worst window %.2f)", req.request_id,
                     found.of_sha256, found.distance, found.verdict.worst_block)
        return found, h, space

    async def _settled(self, record: Record, ev: SettledEvent) -> list[Outgoing]:
        """Apply a settlement: complete, promote or fail the key's waiters."""
        if ev.error is not None and ev.error.code == ErrorCode.MISSING_OBJECT:
            self.lru.drop(ev.cache_key)  # its document is gone: not answered from memory either
        st = self.states[record.partition]
        res = st.settle(ev)
        if res.spilled:
            res.answered.extend(await self._spilled(st, record.partition, ev.cache_key))
        out = self._answer(ev, res)
        if res.index is not None and self.near is not None:
            await self._index(*res.index)
        log.info("dedup: %s settled by %s (%s): %d waiting copies answered%s", ev.cache_key, ev.request_id,
                 ev.status, len(res.answered), f", {res.promoted.request_id} promoted" if res.promoted else "")
        return out

    def _answer(self, ev: SettledEvent, res: Settlement) -> list[Outgoing]:
        """The messages of a settlement: the promoted waiter's inference, the waiters' results."""
        out: list[Outgoing] = []
        if res.promoted is not None:
            self.telemetry.cache.labels("dedup", "promoted", "state").inc()
            log.warning("dedup: %s failed (%s, attempt %d); promoting waiting request %s", ev.request_id,
                        ev.error.code.value if ev.error else "?", ev.attempt, res.promoted.request_id)
            out.append(self._infer(res.promoted, ev.cache_key, res.attempt, self.telemetry.inject(),
                                   traced=True))
        for w in res.answered:
            if res.error is not None:
                err = ResultEvent(request=w, cache_key=ev.cache_key, status="error", error=res.error,
                                  attempt=ev.attempt)
                out.append(self._out(self.s.topics.results, w, err, self.telemetry.inject(), traced=True))
            elif res.settled is not None:
                self.telemetry.cache.labels("dedup", "hit", "single_flight").inc()
                out.append(self._hit(w, ev.cache_key, res.settled, "single_flight", self.telemetry.inject(),
                                     cacheable=ev.cacheable, traced=True))
            else:  # an ok result without a stored output (an older sink): computed on its own
                out.append(self._infer(w, ev.cache_key, 1, self.telemetry.inject(), traced=True))
        return out

    async def _index(self, space: str, h: int, sha: str) -> None:
        try:
            await self.near.index(space, sha, h)
        except CacheUnavailable:
            if len(self._to_index) < 10_000:
                self._to_index.append((space, sha, h))

    # -- messages ---------------------------------------------------------------------------
    def _out(self, topic: str, req: RequestEvent, ev, headers, traced: bool = False) -> Outgoing:
        if traced:  # a waiter answered for its holder: its own trace
            with self.telemetry.span("dedup.complete_waiter", traceparent=req.traceparent, root=True):
                headers = self.telemetry.inject()
        return Outgoing(topic, req.content_sha256, dumps(ev), headers)

    def _infer(self, req: RequestEvent, key: str, attempt: int, headers, traced: bool = False) -> Outgoing:
        """``req`` to inference: on ``ocr.infer-interactive`` for an interactive request, else ``ocr.infer``."""
        topic = self.s.topics.infer_interactive if req.priority == "interactive" else self.s.topics.infer
        return self._out(topic, req, InferEvent(request=req, cache_key=key, attempt=attempt), headers, traced)

    def _hit(self, req: RequestEvent, key: str, s: Settled, tier: str, headers, cacheable: bool = True,
             traced: bool = False) -> Outgoing:
        """``req`` answered from the stored result ``s``: a cache-hit result for the sink."""
        if tier != "single_flight":
            self.telemetry.cache.labels("dedup", "hit", tier).inc()
        gen = self.s.generation(req.task, req.task_params)
        ev = cache_hit_event(req, key, tier, gen, result_uri=s.result_uri, engine=s.engine, model=s.model,
                             model_revision=s.model_revision, cacheable=cacheable)
        return self._out(self.s.topics.results, req, ev, headers, traced)

    def _near_hit(self, req: RequestEvent, key: str, gen, n: NearHit, headers) -> Outgoing:
        self.telemetry.cache.labels("dedup", "hit", "near").inc()
        ev = cache_hit_event(req, key, "near", gen, near_duplicate_of=n.of_sha256,
                             pages=[Page(index=1, width=n.width, height=n.height)], lines=n.lines,
                             warnings=n.output.warnings)
        return self._out(self.s.topics.results, req, ev, headers)

    # -- housekeeping -----------------------------------------------------------------------
    async def after_produce(self) -> None:
        """The batch's messages are acknowledged: write its state changes to the changelog (before
        the runner commits the batch's offsets)."""
        for p, st in list(self.states.items()):
            records = st.writes()
            if records and self.changelog is not None:
                try:
                    await self.changelog.write(p, records)
                except BaseException:
                    st.pending = {**dict(records), **st.pending}  # written on the retry
                    raise

    async def on_idle(self) -> list[Outgoing]:
        """About once a second: evict settled keys past the window, answer or promote waiters
        restored without their holder, retry failed near-duplicate indexing."""
        out: list[Outgoing] = []
        now = now_ms()
        for st in self.states.values():
            st.expire(now)
            for key in st.unheld():
                out.extend(await self._resolve_unheld(st, key, now))
            st.keep()
        retry, self._to_index = self._to_index, []
        for space, sha, h in retry:
            await self._index(space, h, sha)
        self._gauge()
        if not out:
            await self.after_produce()  # the runner calls it only after producing something
        return out

    async def _spilled(self, st: PartitionState, partition: int, key: str) -> list[RequestEvent]:
        """The waiting copies of ``key`` kept in the changelog only (past ``max_waiters``): read
        back from the partition's changelog (one read of it, as a restore), tombstoned."""
        records = (await self.changelog.restore([partition]))[partition] if self.changelog is not None else {}
        found = st.spilled_waiters(key, records)
        log.info("dedup: %s: %d waiting copies read back from the changelog", key, len(found))
        return found

    async def _resolve_unheld(self, st: PartitionState, key: str, now: int) -> list[Outgoing]:
        found = st.settled.get(key)
        if found is not None:
            held, spilled = st.answer_unheld(key)
            if spilled:
                held += await self._spilled(st, st.partition, key)
            return [self._hit(w, key, found, "single_flight", self.telemetry.inject(), traced=True) for w in held]
        first = st.promote_unheld(key)
        if first is None:
            return []
        log.warning("dedup: waiting copies of %s were restored without their holder; %s computes it", key,
                    first.request_id)
        return [self._infer(first, key, 1, self.telemetry.inject(), traced=True)]

    def oversize(self, msg: Outgoing, exc: BaseException, stub: Outgoing) -> list[Outgoing]:
        """A result too large for ``ocr.results`` (a near-duplicate hit carries its lines) also ends
        its request, as ``input_too_large`` (:func:`~services.common.dlq.oversized_result`)."""
        return [stub, *oversized_result(msg, exc)]

    async def poison(self, record: Record, exc: BaseException, attempts: int) -> list[Outgoing]:
        """DLQ the record and fail its request. A settlement that cannot be applied is applied as
        an ``internal_error`` of its request instead (when its key and request id can be read), so
        the copies waiting on the key are not left waiting: the first is promoted while attempts
        are left, else all get the error (those past ``max_waiters`` read back from the changelog
        too)."""
        for st in self.states.values():
            st.rollback()
        out = poison_messages(stage="dedup", topics=self.s.topics, record=record, exc=exc, attempts=attempts)
        if not _is_settlement(record):
            return out
        return out[:1] + await self._settle_failed(record, exc)

    async def _settle_failed(self, record: Record, exc: BaseException) -> list[Outgoing]:
        st = self.states.get(record.partition)
        try:
            v = orjson.loads(record.raw)
            ev = SettledEvent(cache_key=v["cache_key"], content_sha256=v["content_sha256"], request_id=v["request_id"],
                              status="error", attempt=max(1, int(v.get("attempt") or 1)), error=ErrorInfo(
                                  code=ErrorCode.INTERNAL_ERROR,
                                  message=f"dedup could not apply this image's settlement: {exc!r}"[:500]))
        except Exception:  # noqa: BLE001 - unreadable: no key to end (the DLQ event keeps the record)
            return []
        if st is None:
            return []
        try:
            res = st.settle(ev)
            if res.spilled:
                res.answered.extend(await self._spilled(st, record.partition, ev.cache_key))
            out = self._answer(ev, res)
        except Exception as err:  # noqa: BLE001 - a poison path must not raise
            st.rollback()
            log.error("dedup: the failed settlement of %s could not be applied either (%r)", ev.cache_key, err)
            return []
        st.keep()
        return out

    async def close(self) -> None:
        """Close the Redis pool and the near-duplicate decoders."""
        await self.cache.close()
        if self.near is not None:
            await self.near.close()
