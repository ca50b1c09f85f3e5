"""Sink logic: every result becomes a final state per request (its own and its waiters')."""

from __future__ import annotations

import logging
import time

import orjson
from aiokafka import ConsumerRecord

from schemas.errors import RETRYABLE_CODES, ErrorCode
from schemas.events import (
    CompletedEvent, InferEvent, OcrOutput, RequestEvent, ResultDocument, ResultEvent, now_ms,
)
from schemas.keys import request_output_key, result_object_key
from services.common.cache import CacheEntry, CacheUnavailable, ResultCache
from services.common.db import Database
from services.common.dlq import poison_messages
from services.common.errors import OcrError
from services.common.events import completion_event_id, dumps, loads, queue_wait_ms
from services.common.kafka import Outgoing
from services.common.outputs import OutputLru
from services.common.runner import Handler
from services.common.s3 import ObjectStore
from services.common.telemetry import Span, SpanKind, Telemetry, record_attrs
from services.sink.settings import SinkSettings

log = logging.getLogger(__name__)


def full_text(lines) -> str:
    """Lines joined by newlines, pages separated by a blank line."""
    parts: list[str] = []
    page = None
    for line in lines:
        if page is not None and line.page != page:
            parts.append("")
        parts.append(line.text)
        page = line.page
    return "\n".join(parts)


class SinkHandler(Handler):
    """Per result event, in order:

    1. infer result (ok): result document to S3 (``results/<sha>/<gen>.json``), ``results`` row;
    2. cache entry set (ok only) and the waiters on that key read (not yet removed);
    3. one final state per request (the event's and each waiter's) inserted into ``requests``;
    4. one ``ocr.completed`` per request; after Kafka acknowledged them, the waiters are removed
       and the lease released (:meth:`after_produce`).

    A retryable error (``engine_error``, ``internal_error``) ends the holder's request but
    promotes one waiter, re-sent to ``ocr.infer``; any other error is shared by every waiter.
    A result marked ``cacheable=False`` (computed by an infer of another generation than its key's,
    :class:`~services.infer.handler.InferHandler`) skips steps 1 and the cache entry of 2: the
    request and its waiters are completed with it and the lease is released, nothing is stored.
    Every step is idempotent, so a replay after a crash changes nothing.
    """

    def __init__(self, settings: SinkSettings, store: ObjectStore, db: Database, cache: ResultCache, telemetry: Telemetry):
        self.s = settings
        self.store = store
        self.db = db
        self.cache = cache
        self.telemetry = telemetry
        self._outputs = OutputLru(store, settings.output_lru_entries, settings.output_lru_bytes)
        self._pending_end: dict[str, int] = {}  # cache key -> waiters completed, released after the acks
        # cache key -> (entry, ttl, result, output) of results whose waiters could not be read (Redis down)
        self._deferred: dict[str, tuple[CacheEntry | None, int, ResultEvent, OcrOutput | None]] = {}
        self._batch_pending: dict[str, int] = {}
        self._spans: dict[str, Span] = {}  # request id -> its span in this batch (own or waiter's)

    # -- Handler API ----------------------------------------------------------------------
    async def handle(self, records: list[ConsumerRecord]) -> list[Outgoing]:
        """See :meth:`Handler.handle`. Waiters are released only for batches that succeed."""
        self._batch_pending = {}
        self._spans = {}
        docs: list[ResultDocument] = []
        out: list[Outgoing] = []
        for rec in records:
            ev = loads(ResultEvent, rec.value)
            started = time.perf_counter()
            queued = queue_wait_ms(rec)
            with self.telemetry.span("sink", parent_headers=rec.headers, kind=SpanKind.CONSUMER,
                                     attributes=record_attrs(rec)):
                d, extra = await self._one(ev, queued, started, self.telemetry.inject(rec.headers))
            docs.extend(d)
            out.extend(extra)
        out.extend(await self._complete(docs))
        return out

    async def _complete(self, docs: list[ResultDocument]) -> list[Outgoing]:
        """Insert the final states, then one completion per request carrying what the DB holds."""
        out: list[Outgoing] = []
        # one batched write for all requests: a span of its own, linked to each request's span
        links = [lk for sp in self._spans.values() for lk in self.telemetry.link(sp)]
        with self.telemetry.span("sink.write_requests", root=True, links=links,
                                 attributes={"ocrstream.batch_size": len(docs)}):
            docs = await self._whole_in_s3(docs)
            await self.db.write_requests(docs)  # a document over the row bound keeps its summary there
            # Emit what the database holds: a replayed result re-emits the first final state, so a
            # duplicated completion carries the same request id and the same content.
            stored = await self.db.get_requests([d.request_id for d in docs])
        emitted: set[str] = set()
        for doc in docs:
            if doc.request_id in emitted:
                continue
            emitted.add(doc.request_id)
            final = stored[doc.request_id]
            ev = CompletedEvent(event_id=completion_event_id(final.request_id), request_id=final.request_id, result=final)
            headers = self.telemetry.inject([], span=self._spans.get(final.request_id))
            out.append(Outgoing(self.s.topics.completed, final.request_id, dumps(ev), headers))
            self.telemetry.requests_done.labels("sink", final.status, final.error.code.value if final.error else "").inc()
        for key, n in self._batch_pending.items():
            self._pending_end[key] = max(n, self._pending_end.get(key, 0))
        return out

    async def _whole_in_s3(self, docs: list[ResultDocument]) -> list[ResultDocument]:
        """Give each ok document that is over the database row bound and has no ``result_uri`` (a
        result stored under no cache key: ``cacheable=False``) its OCR output in S3 at
        :func:`~schemas.keys.request_output_key`, so the row, which leaves its lines out, points to the whole."""
        out = []
        for d in docs:
            if (d.status == "ok" and d.result_uri is None and (d.lines or d.text)
                    and len(d.model_dump_json(by_alias=True).encode()) > self.s.mysql.row_max_bytes):
                okey = request_output_key(d.request_id)
                whole = OcrOutput(
                    cache_key=d.cache_key or "", content_sha256=d.content_sha256 or "", engine=d.engine or "",
                    model=d.model or "", model_revision=d.model_revision or "", task=d.task, pages=d.pages,
                    lines=d.lines, text=d.text, near_duplicate_of=d.near_duplicate_of, warnings=d.warnings)
                await self.store.put(okey, dumps(whole), "application/json")
                d = d.model_copy(update={"result_uri": self.store.uri(okey)})
            out.append(d)
        return out

    async def on_idle(self) -> list[Outgoing]:
        """Complete waiters whose holder finished while Redis was down, once Redis answers again.

        A key leaves the deferred set only with its completions: if writing them fails (MariaDB
        down, say), it goes back and the next pass begins it again (:meth:`ResultCache.complete_begin`
        is safe to repeat: the waiters stay in Redis until :meth:`after_produce`)."""
        if not self._deferred:
            return []
        self._batch_pending, self._spans = {}, {}
        docs: list[ResultDocument] = []
        taken: dict[str, tuple] = {}
        for key, item in list(self._deferred.items()):
            entry, ttl_s, ev, output = item
            try:
                raw = await self.cache.complete_begin(key, entry, ttl_s, holder=ev.request.request_id)
            except CacheUnavailable:
                break
            taken[key] = self._deferred.pop(key)
            if raw is None:  # another request holds the key now: its result completes the waiters
                continue
            self._batch_pending[key] = len(raw)
            for w in raw:
                docs.append(self._doc(RequestEvent.model_validate_json(w), output, ev, 0.0, time.perf_counter(),
                                      cache_hit=output is not None))
        if docs:
            log.info("sink: Redis is back: completing %d waiting request(s)", len(docs))
        try:
            out = await self._complete(docs) if docs or self._batch_pending else []
        except BaseException:
            self._deferred.update(taken)  # tried again on the next pass
            raise
        if not out and self._pending_end:  # nobody was waiting: nothing to produce, release now
            await self.after_produce()  # (the runner calls it only after producing something)
        return out

    async def after_produce(self) -> None:
        """Completions are durable: remove the completed waiters and release the leases."""
        pending, self._pending_end = self._pending_end, {}
        for key, n in pending.items():
            try:
                await self.cache.complete_end(key, n)
            except CacheUnavailable as exc:
                log.warning("sink: could not release lease %s (%s); it expires on its own", key, exc)

    def poison(self, record: ConsumerRecord, exc: BaseException, attempts: int) -> list[Outgoing]:
        """DLQ the record; fail its request unless the record already was an error result."""
        try:
            already_error = orjson.loads(record.value).get("status") == "error"
        except Exception:
            already_error = False
        out = poison_messages(stage="sink", topics=self.s.topics, record=record, exc=exc, attempts=attempts)
        return out[:1] if already_error else out

    async def dependencies_ok(self) -> bool:
        """True when MariaDB and S3 both answer a fresh ping (the stores a result is written to;
        Redis down is handled on its own: the waiters are completed later). See :meth:`Handler.dependencies_ok`."""
        try:
            return bool(await self.db.ping()) and bool(await self.store.ping())
        except Exception:  # noqa: BLE001 - any failure to answer is "down"
            return False

    async def close(self) -> None:
        """Close the Redis pool."""
        await self.cache.close()

    # -- steps ----------------------------------------------------------------------------
    async def _one(self, ev: ResultEvent, queued: float, started: float, headers) -> tuple[list[ResultDocument], list[Outgoing]]:
        req = ev.request
        key = ev.cache_key
        extra: list[Outgoing] = []
        if ev.status == "ok":
            if ev.cache_hit and ev.near_duplicate_of is None:  # exact hit: the document exists
                try:
                    output = await self._outputs.load(ev.result_uri)
                except OcrError as err:
                    if err.code != ErrorCode.MISSING_OBJECT:
                        raise
                    # The cached document vanished (purged bucket): compute it again.
                    log.warning("sink: cached result %s is gone; re-sending %s to inference", ev.result_uri, req.request_id)
                    return [], [Outgoing(self.s.topics.infer, req.content_sha256, dumps(InferEvent(request=req, cache_key=key)), headers)]
                # No waiters and no lease to release: requests arriving while an entry exists are hits
                # themselves (dedup's claim and complete_begin are atomic), and a lease on this key now
                # (the entry expired since) belongs to another request's inference, not to this hit.
                return [self._doc(req, output, ev, queued, started, cache_hit=True)], extra
            if not ev.cacheable:
                # computed by an infer of another generation (rolling upgrade, InferHandler): the
                # request and its waiters get it, nothing is stored under this key, the lease goes
                log.warning("sink: result for %s is not of %s's generation (%s @ %s); not cached",
                            req.request_id, key, ev.model, ev.model_revision)
                output = self._output(ev)
                waiters = await self._waiters(key, None, 0, ev, output)
                return [self._doc(r, output, ev, queued, started, cache_hit=r is not req)
                        for r in [req, *waiters]], extra
            # computed, or a near-duplicate hit (lines rescaled by dedup): stored under this key
            output, entry = await self._store_output(ev)
            waiters = await self._waiters(key, entry, self.s.ttl_for(req.source, req.task), ev, output)
            docs = [self._doc(r, output, ev, queued, started, cache_hit=ev.cache_hit or r is not req)
                    for r in [req, *waiters]]
            return docs, extra
        # error
        waiters: list[RequestEvent] = []
        if key:
            code = ev.error.code if ev.error else ErrorCode.INTERNAL_ERROR
            if code in RETRYABLE_CODES and ev.attempt < self.s.max_attempts:
                try:
                    p = await self.cache.promote(key, self.s.lease_ms, expected_holder=req.request_id,
                                                 attempt=ev.attempt + 1)
                    if p.outcome == "promoted" and p.raw:
                        promoted = RequestEvent.model_validate_json(p.raw)
                        log.warning("sink: %s failed (%s); promoting waiter %s", req.request_id, code.value, promoted.request_id)
                        extra.append(Outgoing(self.s.topics.infer, promoted.content_sha256,
                                              dumps(InferEvent(request=promoted, cache_key=key, attempt=p.attempt)), headers))
                except CacheUnavailable:
                    pass
            else:
                waiters = await self._waiters(key, None, 0, ev, None)
        docs = [self._doc(r, None, ev, queued, started, cache_hit=False) for r in [req, *waiters]]
        return docs, extra

    async def _waiters(self, key: str | None, entry: CacheEntry | None, ttl_s: int, ev: ResultEvent,
                       output: OcrOutput | None) -> list[RequestEvent]:
        if not key:
            return []
        try:
            raw = await self.cache.complete_begin(key, entry, ttl_s, holder=ev.request.request_id)
        except CacheUnavailable as exc:
            # Completed from on_idle as soon as Redis answers (bounded: one entry per key); if this
            # process dies first, the lease expires and dedup's reaper promotes a waiter instead.
            if len(self._deferred) < self.s.deferred_max_keys:
                self._deferred[key] = (entry, ttl_s, ev, output)
            log.warning("sink: Redis unavailable (%s); waiters on %s will be completed when it is back", exc, key)
            return []
        if raw is None:
            # not cached, and another request holds the lease (a promoted waiter, or a newer
            # request after this result was first handled: a replay): its result completes them
            log.info("sink: %s's waiters on %s belong to the current lease holder", ev.request.request_id, key)
            return []
        self._batch_pending[key] = len(raw)
        return [RequestEvent.model_validate_json(w) for w in raw]

    @staticmethod
    def _output(ev: ResultEvent) -> OcrOutput:
        req = ev.request
        return OcrOutput(
            cache_key=ev.cache_key, content_sha256=req.content_sha256, engine=ev.engine or "", model=ev.model or "",
            model_revision=ev.model_revision or "", task=req.task, pages=ev.pages, lines=ev.lines,
            text=full_text(ev.lines), near_duplicate_of=ev.near_duplicate_of, warnings=ev.warnings,
        )

    async def _store_output(self, ev: ResultEvent) -> tuple[OcrOutput, CacheEntry]:
        req = ev.request
        output = self._output(ev)
        okey = result_object_key(ev.cache_key)
        body = dumps(output)
        await self.store.put(okey, body, "application/json")
        uri = self.store.uri(okey)
        await self.db.write_result(
            cache_key=ev.cache_key, content_sha256=req.content_sha256, engine=output.engine, model=output.model,
            model_revision=output.model_revision, task=req.task, result_uri=uri, line_count=len(output.lines),
            text=output.text, created_at_ms=output.created_at_ms,
        )
        self._outputs.remember(uri, output, len(body))
        return output, CacheEntry(uri, len(output.lines), len(output.text), output.created_at_ms)

    def _doc(self, req: RequestEvent, output: OcrOutput | None, ev: ResultEvent, queued: float,
             started: float, cache_hit: bool) -> ResultDocument:
        completed = now_ms()
        own = req is ev.request
        # a waiter completed on the holder's behalf stays in its own trace, linked to the holder's
        span = self.telemetry.current_span() if own else self.telemetry.start_span(
            "sink.complete_waiter", traceparent=req.traceparent, root=True,
            links=self.telemetry.link(self.telemetry.current_span()))
        self._spans[req.request_id] = span
        timings = dict(req.timings_ms if not own else ev.request.timings_ms)
        timings["queue_sink"] = round(queued, 3) if own else 0.0
        timings["write"] = round((time.perf_counter() - started) * 1000, 3)
        timings["total"] = float(max(0, completed - req.submitted_at_ms))
        pages = output.pages if output else ev.pages
        first = pages[0] if pages else None
        doc = ResultDocument(
            request_id=req.request_id,
            status=ev.status,
            error=ev.error if ev.status == "error" else None,
            content_sha256=req.content_sha256,
            cache_key=ev.cache_key,
            cache_hit=cache_hit,
            near_duplicate_of=output.near_duplicate_of if output else None,
            engine=ev.engine,
            model=ev.model,
            model_revision=ev.model_revision,
            width=first.width if first else req.width,
            height=first.height if first else req.height,
            pages=pages,
            lines=output.lines if output else [],
            text=output.text if output else "",
            warnings=output.warnings if output else ev.warnings,
            task=req.task,
            source=req.source,
            filename=req.filename,
            result_uri=(self.store.uri(result_object_key(ev.cache_key))
                        if output and ev.cache_key and ev.cacheable else None),
            submitted_at_ms=req.submitted_at_ms,
            completed_at_ms=completed,
            timings_ms=timings,
            trace_id=self.telemetry.trace_id(span),
            callback_url=req.callback_url,
            api_key_id=req.api_key_id,
            metadata=req.metadata,
        )
        with self.telemetry.use(span):
            log.info("sink: request %s completed: %s%s in %.0f ms", req.request_id, ev.status,
                     " (cache hit)" if cache_hit else "", timings["total"])
        if not own:
            span.end()
        return doc
