"""Sink logic: every result becomes a request's final state; every computed cache key is settled."""

from __future__ import annotations

import logging
import time

import orjson

from schemas.errors import ErrorCode
from schemas.events import (
    CompletedEvent,
    OcrOutput,
    RequestEvent,
    ResultDocument,
    ResultEvent,
    SettledEvent,
    now_ms,
)
from schemas.keys import request_output_key, result_object_key
from schemas.reading import WARNING_TRUNCATED_MAX_TOKENS, WARNING_TRUNCATED_REPETITION, ErrorInfo
from services.common.cache.entries import CacheEntry, CacheUnavailable, ResultCache
from services.common.db import Database
from services.common.results.rows import ResultRows
from services.common.dlq import poison_messages
from services.common.errors import OcrError
from services.common.codec import completion_event_id, dumps
from services.common.cache.field_index import forget_extraction, record_extraction
from services.common.handler import Handler, Outgoing, Record
from services.common.cache.outputs import OutputLru
from services.common.results.build import document_output, ocr_output, result_document
from services.common.s3 import ObjectStore
from services.common.telemetry import Span, Telemetry
from services.sink.document_cache import cache_document
from services.common.documents.assembly import DocumentAssembler
from services.sink.settings import SinkSettings

log = logging.getLogger(__name__)


class SinkHandler(Handler):
    """Per result event, in order:

    1. a computed result (ok, or a near-duplicate hit, whose lines dedup rescaled): the result
       document to S3 (``results/<sha>/<gen>.json``), the ``results`` row (and ``result_fields``
       rows), an ``extract`` result's field index entry (:mod:`services.common.cache.field_index`), and
       the Redis entry when Redis answers (no Redis: nothing waits for it, dedup's state and the
       S3 tier answer);
    2. the request's final state inserted into ``requests`` (a request already there keeps its first);
    3. its ``ocr.completed`` event, and for every result computed under a cache key (ok or error,
       never a cache hit) a settlement (``ocr.settled.v1``) on ``ocr.requests``, keyed by content
       SHA-256 like the key's requests (after them in their partition's log), from which dedup
       completes the copies waiting on the key (:mod:`services.dedup.state`). The runner produces
       them only after 1 and 2 are durable, and commits only after Kafka acknowledged them.
    4. a page of a document: its final state recorded in ``document_pages``; when it is the page
       that makes every page final, the document is assembled (:mod:`services.common.documents.assembly`),
       its own final state inserted like any request's and its completion emitted after the page's;
       an ``ok`` one is cached under its file's key (:mod:`services.sink.document_cache`).

    A cache hit reads the stored document (through an in-memory LRU). A hit from the S3 tier warms
    Redis again; a hit whose document is gone (a purged bucket) ends with ``missing_object``, its
    Redis entry is deleted and a ``missing_object`` settlement drops the pointer dedup keeps. A
    result marked ``cacheable=False`` (computed by an infer of another generation than its key's)
    is stored under the request (:func:`~schemas.keys.request_output_key`), never under the key;
    its settlement points there, so the waiting copies get it too. Every step is idempotent, so a
    replay after a crash changes nothing.
    """

    def __init__(self, settings: SinkSettings, store: ObjectStore, db: Database, cache: ResultCache, telemetry: Telemetry):
        self.s = settings
        self.store = store
        self.db = db
        self.rows = ResultRows(db)
        self.cache = cache
        self.telemetry = telemetry
        self._outputs = OutputLru(store, settings.output_lru_entries, settings.output_lru_bytes)
        self.documents = DocumentAssembler(
            db, store, self._outputs, settings.max_page_error_rate,
            on_assembled=lambda doc, finals, final: cache_document(settings, store, db, cache, doc, finals, final))
        self._spans: dict[str, Span] = {}  # request id -> its span in this batch
        self._settle: list[Outgoing] = []  # settlements of this batch

    # -- Handler API ----------------------------------------------------------------------
    def consumes(self) -> dict[str, type[ResultEvent]]:
        """``ocr.results`` -> :class:`ResultEvent` (see :meth:`Handler.consumes`; a value that does
        not decode fails like one that raises)."""
        return {self.s.topics.results: ResultEvent}

    async def handle(self, records: list[Record[ResultEvent]]) -> list[Outgoing]:
        """See :meth:`Handler.handle`: the batch's completions, then its settlements."""
        self._spans, self._settle = {}, []
        docs: list[ResultDocument] = []
        for rec in records:
            started = time.perf_counter()
            queued = rec.queue_wait_ms()
            with rec.traced():
                docs.append(await self._one(rec.value, queued, started))
        out = await self._complete(docs)
        out.extend(self._settle)
        return out

    async def _complete(self, docs: list[ResultDocument]) -> list[Outgoing]:
        """Insert the final states, then one completion per request carrying what the DB holds."""
        out: list[Outgoing] = []
        # one batched write for all requests: a span of its own, linked to each request's span
        links = [lk for sp in self._spans.values() for lk in self.telemetry.link(sp)]
        with self.telemetry.span("sink.write_requests", root=True, links=links,
                                 attributes={"ocrstream.batch_size": len(docs)}):
            docs = await self._whole_in_s3(docs)
            # Emit what the database holds (a document over the row bound keeps its summary there):
            # a replayed result re-emits the first final state, so a duplicated completion carries
            # the same request id and the same content.
            stored = await self.rows.write_requests(docs)
            finals = [stored[rid] for rid in dict.fromkeys(d.request_id for d in docs)]
            # pages of documents: recorded, and the documents they complete assembled (services/common/documents/assembly.py)
            assembled = [a for did in await self.documents.completed_documents(finals)
                         if (a := await self.documents.assemble(did)) is not None]
            if assembled:
                held = await self.rows.write_requests(assembled)
                finals.extend(held[a.request_id] for a in assembled)
        for final in finals:
            ev = CompletedEvent(event_id=completion_event_id(final.request_id), request_id=final.request_id, result=final)
            headers = self.telemetry.inject([], span=self._spans.get(final.request_id))
            out.append(Outgoing(self.s.topics.completed, final.request_id, dumps(ev), headers))
            self.telemetry.requests_done.labels("sink", final.status, final.error.code.value if final.error else "").inc()
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
                await self.store.put(okey, dumps(document_output(d)), "application/json")
                d = d.model_copy(update={"result_uri": self.store.uri(okey)})
            out.append(d)
        return out

    def poison(self, record: Record, exc: BaseException, attempts: int) -> list[Outgoing]:
        """DLQ the record; fail its request unless the record already was an error result, and then
        settle its cache key with ``internal_error`` (the copies waiting on it must not wait forever;
        an ok result's error result carries its request and cache key, comes back here and settles it)."""
        try:
            value = orjson.loads(record.raw)
            already_error = value.get("status") == "error"
        except Exception:
            value, already_error = {}, False
        if not already_error:
            # the error result carries the request and its cache key: it comes back here, becomes the
            # request's final state and settles the key, so the copies waiting on it are answered
            try:
                request, key = RequestEvent.model_validate(value["request"]), value.get("cache_key")
            except Exception:  # noqa: BLE001 - not a result event we can read: the id only
                request, key = None, None
            return poison_messages(stage="sink", topics=self.s.topics, record=record, exc=exc, attempts=attempts,
                                   request=request, cache_key=key if isinstance(key, str) else None)
        out = poison_messages(stage="sink", topics=self.s.topics, record=record, exc=exc, attempts=attempts)
        req, key = value.get("request") or {}, value.get("cache_key")
        if isinstance(key, str) and isinstance(req, dict) and req.get("request_id") and req.get("content_sha256"):
            ev = SettledEvent(cache_key=key, content_sha256=req["content_sha256"], request_id=req["request_id"],
                              status="error", attempt=max(1, int(value.get("attempt") or 1)),
                              error=ErrorInfo(code=ErrorCode.INTERNAL_ERROR,
                                              message=f"the sink could not write this result: {exc!r}"[:500]))
            out.append(Outgoing(self.s.topics.requests, ev.content_sha256, dumps(ev), []))
        return out[:1] + out[2:]

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
    async def _one(self, ev: ResultEvent, queued: float, started: float) -> ResultDocument:
        req = ev.request
        if ev.status == "ok" and ev.cache_hit and ev.near_duplicate_of is None:  # exact hit: the document exists
            try:
                output = await self._outputs.load(ev.result_uri)
            except OcrError as err:
                if err.code != ErrorCode.MISSING_OBJECT:
                    raise
                return await self._gone(ev, queued, started)
            if ev.cache_tier == "s3" and ev.cacheable:
                await self._put_entry(ev, output, ev.result_uri)  # recalled from S3: Redis answers the next one
            return self._doc(req, output, ev, queued, started, cache_hit=True)
        if ev.status == "ok":
            if not ev.cacheable:
                # computed by an infer of another generation (rolling upgrade, InferHandler): stored
                # under the request, never under the key; the waiting copies are answered from it
                log.warning("sink: result for %s is not of %s's generation (%s @ %s); not cached",
                            req.request_id, ev.cache_key, ev.model, ev.model_revision)
                output = ocr_output(ev)
                okey = request_output_key(req.request_id)
                await self.store.put(okey, dumps(output), "application/json")
                self._settled(ev, result_uri=self.store.uri(okey))
                return self._doc(req, output, ev, queued, started, cache_hit=ev.cache_hit)
            # computed, or a near-duplicate hit (lines rescaled by dedup): stored under this key
            output, uri = await self._store_output(ev)
            await self._put_entry(ev, output, uri)
            self._settled(ev, result_uri=uri)
            return self._doc(req, output, ev, queued, started, cache_hit=ev.cache_hit)
        if ev.cache_key:
            self._settled(ev)
        return self._doc(req, None, ev, queued, started, cache_hit=False)

    async def _gone(self, ev: ResultEvent, queued: float, started: float) -> ResultDocument:
        """A cache hit whose document vanished (a purged bucket): its Redis entry goes, a
        ``missing_object`` settlement drops dedup's pointer, and the request ends with that error
        (submitting it again computes it)."""
        log.warning("sink: cached result %s of %s is gone", ev.result_uri, ev.request.request_id)
        try:
            if ev.cache_key:
                await self.cache.delete(ev.cache_key)
        except CacheUnavailable:
            pass
        gone = ev.model_copy(update={"status": "error", "cache_hit": False, "error": ErrorInfo(
            code=ErrorCode.MISSING_OBJECT,
            message=f"the stored result {ev.result_uri} is gone (purged?); submit the image again to compute it")})
        if ev.cache_key:
            self._settled(gone)
        return self._doc(ev.request, None, gone, queued, started, cache_hit=False)

    def _settled(self, ev: ResultEvent, result_uri: str | None = None) -> None:
        """Queue the settlement of ``ev``'s cache key for ``ocr.requests`` (produced after this batch's writes)."""
        req = ev.request
        st = SettledEvent(cache_key=ev.cache_key, content_sha256=req.content_sha256, request_id=req.request_id,
                          status=ev.status, error=ev.error, attempt=max(1, ev.attempt), cacheable=ev.cacheable,
                          result_uri=result_uri, engine=ev.engine, model=ev.model, model_revision=ev.model_revision,
                          near=ev.near_duplicate_of is not None)
        self._settle.append(Outgoing(self.s.topics.requests, req.content_sha256, dumps(st), self.telemetry.inject()))

    async def _put_entry(self, ev: ResultEvent, output: OcrOutput, uri: str) -> None:
        """The key's Redis entry, when Redis answers (a cache: without it dedup's S3 tier answers)."""
        entry = CacheEntry(uri, len(output.lines), len(output.text), output.created_at_ms)
        try:
            await self.cache.put(ev.cache_key, entry, self.s.ttl_for(ev.request.source, ev.request.task))
        except CacheUnavailable as exc:
            log.info("sink: Redis unavailable (%s); no cache entry for %s", exc, ev.cache_key)

    async def _store_output(self, ev: ResultEvent) -> tuple[OcrOutput, str]:
        req = ev.request
        output = ocr_output(ev)
        okey = result_object_key(ev.cache_key)
        body = dumps(output)
        await self.store.put(okey, body, "application/json")
        uri = self.store.uri(okey)
        await self.rows.write_result(
            cache_key=ev.cache_key, content_sha256=req.content_sha256, engine=output.engine, model=output.model,
            model_revision=output.model_revision, task=req.task, result_uri=uri, line_count=len(output.lines),
            text=output.text, created_at_ms=output.created_at_ms,
            fields=output.fields,  # extract: one result_fields row per field (migration 007)
        )
        self._outputs.remember(uri, output, len(body))
        if output.fields is not None:
            await self._index_fields(ev, output)
        return output, uri

    async def _index_fields(self, ev: ResultEvent, output: OcrOutput) -> None:
        """The field index entry of an ``extract`` result just stored
        (:func:`services.common.cache.field_index.record_extraction`), so a request for some of its
        fields is answered from it. Not for an answer cut short (``truncated_max_tokens``,
        ``truncated_repetition``: a null may be the cut, not the page), nor for a key this sink's
        settings would not build (the family in the entry's path must be the key's); a failed
        write only costs those answers (logged). A cut answer stored over a whole one of the same
        key (computed again after a purge, or when dedup's S3 tier missed) removes the entry the
        whole one left (:func:`services.common.cache.field_index.forget_extraction`): dedup only HEADs
        the document an entry points at, and would answer subsets from the cut one."""
        req = ev.request
        gen = self.s.generation(req.task, req.task_params)
        if self.s.cache_key_of(req.content_sha256, gen, req.api_key_id) != ev.cache_key:
            log.info("sink: %s is not of this sink's generation; its fields are not indexed", ev.cache_key)
            return
        cut = bool({WARNING_TRUNCATED_MAX_TOKENS, WARNING_TRUNCATED_REPETITION} & set(output.warnings))
        try:
            if cut:
                await forget_extraction(self.store, ev.cache_key, gen, output.fields)
            else:
                await record_extraction(self.store, ev.cache_key, gen, output.fields)
        except Exception as exc:  # noqa: BLE001 - the index is an optimisation: a miss later, not an error now
            log.warning("sink: field index entry of %s not %s (%r)", ev.cache_key, "removed" if cut else "written", exc)

    def _doc(self, req: RequestEvent, output: OcrOutput | None, ev: ResultEvent, queued: float,
             started: float, cache_hit: bool) -> ResultDocument:
        completed = now_ms()
        own = req is ev.request
        # a waiter completed on the holder's behalf stays in its own trace, linked to the holder's
        span = self.telemetry.current_span() if own else self.telemetry.start_span(
            "sink.complete_waiter", traceparent=req.traceparent, root=True,
            links=self.telemetry.link(self.telemetry.current_span()))
        self._spans[req.request_id] = span
        stored = self.store.uri(result_object_key(ev.cache_key)) if output is not None and ev.cache_key else None
        doc = result_document(
            req, ev, output, cache_hit=cache_hit, stored_uri=stored, completed_at_ms=completed,
            trace_id=self.telemetry.trace_id(span),
            timings_ms={"queue_sink": round(queued, 3) if own else 0.0,
                        "write": round((time.perf_counter() - started) * 1000, 3)})
        with self.telemetry.use(span):
            log.info("sink: request %s completed: %s%s in %.0f ms", req.request_id, ev.status,
                     " (cache hit)" if cache_hit else "", doc.timings_ms["total"])
        if not own:
            span.end()
        return doc
