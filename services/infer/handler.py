"""Infer logic: a micro-batch of ``ocr.infer`` events -> fetch, decode, tile, engine -> ``ocr.results``."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
from aiokafka import ConsumerRecord
from pydantic import ValidationError

from schemas.errors import ErrorCode
from schemas.events import ErrorInfo, InferEvent, Line, Page, ResultEvent
from schemas.keys import CacheGeneration, split_cache_key
from services.common.dlq import poison_messages
from services.common.errors import OcrError
from services.common.events import dumps, loads, queue_wait_ms
from services.common.imaging import decode
from services.common.kafka import Outgoing
from services.common.runner import Handler
from services.common.s3 import ObjectStore
from services.common.telemetry import Span, SpanKind, StatusCode, Telemetry, record_attrs
from services.common.textlines import group_lines
from services.infer.engines.base import EngineTimeout, OcrEngine
from services.infer.settings import InferSettings
from services.infer.tiles import make_tiles, map_back

log = logging.getLogger(__name__)


def generation_matches(cache_key: str | None, own: CacheGeneration) -> bool:
    """Whether a result computed under generation ``own`` may be stored under ``cache_key``.

    dedup chose the key (``<gen_id>:<sha256>``, :func:`schemas.keys.cache_key`) from its own
    settings; during a rolling upgrade an infer process still on the old model (or already on the
    new one) can receive it. False when the key's generation id is not ``own.gen_id`` or the key
    is not a cache key; True for no key at all (nothing would be stored).
    """
    if cache_key is None:
        return True
    try:
        gen_id, _ = split_cache_key(cache_key)
    except ValueError:
        return False
    return gen_id == own.gen_id


@dataclass
class _Item:
    record: ConsumerRecord
    event: InferEvent
    timings: dict[str, float] = field(default_factory=dict)
    pages: list[np.ndarray] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # from the engine, once each, in order seen
    error: OcrError | None = None
    span: Span | None = None  # the request's ``infer`` span, ended in ``_result``


def _load_span(fn):
    """Run ``_fetch_decode(it)`` in an ``infer.load`` span of the request's trace (prefetched or not)."""

    @functools.wraps(fn)
    async def wrapper(self: "InferHandler", it: _Item):
        with self.telemetry.span("infer.load", parent_headers=it.record.headers, attributes=record_attrs(it.record)):
            return await fn(self, it)

    return wrapper


class InferHandler(Handler):
    """Runs one micro-batch: S3 gets in parallel, decoding in threads, one engine call for all
    tiles of all pages in the batch, then one result per request.

    A failing image (bad data, timeout, engine error) gets an error result; the rest of the
    batch goes on. A store outage raises (the runner retries the batch with backoff).

    Generation check (rolling upgrades): dedup put its own generation in the event's cache key;
    when this process's generation (:meth:`CommonSettings.generation`: engine, model, revision,
    task, preprocessing, options) differs, the request is still computed and its result sent, but
    marked ``cacheable=False``: the sink completes the request and every waiter on the key with
    it (labelled with this process's engine, model and revision), releases the lease, and stores
    no cache entry, result document or results row under the key, so the key's generation never
    holds another model's output. The next request for the image is a miss and is computed again,
    by a process of the right generation once the upgrade is through. Counted as
    ``ocrstream_cache_total{stage="infer",outcome="generation_mismatch"}`` and logged (WARNING).
    """

    def __init__(self, settings: InferSettings, store: ObjectStore, engine: OcrEngine, telemetry: Telemetry):
        self.s = settings
        self.store = store
        self.engine = engine
        self.telemetry = telemetry
        self._fetch_sem = asyncio.Semaphore(settings.fetch_concurrency)
        # next batch's images, fetched and decoded while the current batch is on the engine
        self._prefetched: dict[tuple[str, int, int], asyncio.Task] = {}
        self._gens: dict[str, CacheGeneration] = {}  # task -> this process's generation

    def prefetch(self, records: list[ConsumerRecord]) -> None:
        """Start fetching and decoding the next batch's images (bounded by the runner's buffer)."""
        for rec in records:
            try:
                ev = loads(InferEvent, rec.value)
            except (ValueError, ValidationError):
                continue  # handle() sends it to the DLQ
            it = _Item(rec, ev, {})
            task = asyncio.ensure_future(self._fetch_decode(it))
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)  # no "never retrieved"
            self._prefetched[(rec.topic, rec.partition, rec.offset)] = task

    def forget(self, records: list[ConsumerRecord]) -> None:
        """Cancel the prefetches of ``records`` (their partitions were revoked; see :meth:`Handler.forget`)."""
        for rec in records:
            task = self._prefetched.pop((rec.topic, rec.partition, rec.offset), None)
            if task is not None:
                task.cancel()

    async def handle(self, records: list[ConsumerRecord]) -> list[Outgoing]:
        """See :meth:`Handler.handle`."""
        out: list[Outgoing] = []
        items: list[_Item] = []
        for rec in records:
            try:
                ev = loads(InferEvent, rec.value)
            except (ValueError, ValidationError) as exc:
                out.extend(self.poison(rec, OcrError(ErrorCode.INVALID_REQUEST, str(exc)[:500]), 1))
                continue
            items.append(_Item(rec, ev, {"queue_infer": queue_wait_ms(rec)}, span=self._request_span(rec)))
        await asyncio.gather(*(self._load(it) for it in items))
        await self._infer([it for it in items if it.error is None])
        for it in items:
            out.append(self._result(it))
        return out

    @_load_span
    async def _fetch_decode(self, it: _Item) -> tuple[list[np.ndarray], dict[str, float], OcrError | None]:
        limits = self.s.limits
        timings: dict[str, float] = {}
        try:
            async with self._fetch_sem:
                t0 = time.perf_counter()
                data = await self.store.get_uri(it.event.request.image_uri, max_bytes=limits.max_image_bytes)
            t1 = time.perf_counter()
            timings["fetch"] = (t1 - t0) * 1000
            pages = await asyncio.to_thread(decode, data, limits.max_pixels, limits.max_pages)
            timings["decode"] = (time.perf_counter() - t1) * 1000
            return pages, timings, None
        except OcrError as err:
            if err.code == ErrorCode.MISSING_OBJECT:
                raise  # retried a bounded number of times, then DLQ + error result (Handler.poison)
            return [], timings, err

    async def _load(self, it: _Item) -> None:
        rec = it.record
        task = self._prefetched.pop((rec.topic, rec.partition, rec.offset), None)
        pages, timings, err = await (task if task is not None else self._fetch_decode(it))
        it.pages, it.error = pages, err
        it.timings.update(timings)

    def _request_span(self, rec: ConsumerRecord) -> Span:
        return self.telemetry.start_span("infer", parent_headers=rec.headers, kind=SpanKind.CONSUMER,
                                         attributes=record_attrs(rec))

    async def _infer(self, items: list[_Item]) -> None:
        """One engine call for every tile of every page of ``items``.

        Timings per item: ``preprocess`` and ``postprocess`` are equal shares of the batch's
        tiling and line grouping; ``inference`` is the item's share of the engine call's wall
        time, weighted by the engine time its tiles took.
        """
        if not items:
            return
        links = [lk for it in items for lk in self.telemetry.link(it.span)]
        # one span per batch, in a trace of its own, linked to every request's span
        with self.telemetry.span("infer.engine_batch", root=True, links=links,
                                 attributes={"ocrstream.batch_size": len(items), "ocrstream.engine": self.engine.name}) as sp:
            t0 = time.perf_counter()
            jobs = []  # (item, page index, tile)
            for it in items:
                for p, page in enumerate(it.pages):
                    for tile in make_tiles(page, self.s.tile_max_aspect, self.engine.max_side):
                        jobs.append((it, p, tile))
            sp.set_attribute("ocrstream.tiles", len(jobs))
            t_engine = time.perf_counter()
            prep_ms = (t_engine - t0) * 1000
            outputs = await self.engine.ocr([t.image for _, _, t in jobs], self.s.limits.infer_timeout_s)
            t1 = time.perf_counter()
            engine_ms = (t1 - t_engine) * 1000
            self.telemetry.engine_batch(self.engine.name, len(items), t1 - t_engine)
            per_page: dict[tuple[int, int], list] = {}
            weight: dict[int, float] = {}
            for (it, p, tile), res in zip(jobs, outputs):
                if it.error is not None:
                    continue
                if isinstance(res, BaseException):
                    code = (ErrorCode.TIMEOUT if isinstance(res, EngineTimeout)
                        else ErrorCode.IMAGE_TOO_LARGE if isinstance(res, MemoryError)  # deterministic: not retried
                        else ErrorCode.ENGINE_ERROR)
                    it.error = OcrError(code, str(res) or type(res).__name__)
                    continue
                weight[id(it)] = weight.get(id(it), 0.0) + res.inference_ms
                it.warnings.extend(w for w in res.warnings if w not in it.warnings)
                h, w = it.pages[p].shape[:2]
                per_page.setdefault((id(it), p), []).extend(map_back(tile, res.segments, w, h))
            for it in items:
                if it.error is not None:
                    continue
                lines = []
                for p in range(len(it.pages)):
                    for seg in group_lines(per_page.get((id(it), p), [])):
                        lines.append(Line(text=seg.text, box=seg.box, confidence=round(seg.confidence, 4), page=p + 1))
                it.lines = lines
            post_ms = (time.perf_counter() - t1) * 1000
            total_w = sum(weight.get(id(it), 0.0) for it in items)
            for it in items:
                share = weight.get(id(it), 0.0) / total_w if total_w > 0 else 1 / len(items)
                it.timings["preprocess"] = prep_ms / len(items)
                it.timings["inference"] = engine_ms * share
                it.timings["postprocess"] = post_ms / len(items)

    def _result(self, it: _Item) -> Outgoing:
        ev, req = it.event, it.event.request
        # The record's whole stay in this stage (Kafka timestamp -> now) = queue + own work +
        # waiting on the rest of the batch. Prefetched images were fetched and decoded while
        # still "queued", so the queue share is what the work does not explain.
        stay = max(0.0, time.time() * 1000 - it.record.timestamp)
        work = sum(it.timings.get(k, 0.0) for k in ("fetch", "decode", "preprocess", "inference", "postprocess"))
        it.timings["queue_infer"] = min(it.timings.get("queue_infer", 0.0), max(0.0, stay - work))
        it.timings["batch_wait"] = max(0.0, stay - work - it.timings["queue_infer"])
        timings = dict(req.timings_ms, **{k: round(v, 3) for k, v in it.timings.items()})
        own = self._generation(req.task)
        cacheable = generation_matches(ev.cache_key, own)
        common = dict(
            request=req.model_copy(update={"timings_ms": timings}), cache_key=ev.cache_key,
            engine=own.engine, model=own.model, model_revision=own.model_revision, attempt=ev.attempt,
            cacheable=cacheable,
        )
        if not cacheable:
            self.telemetry.cache.labels("infer", "generation_mismatch", "").inc()
            log.warning("infer: request %s has cache key %s but this process computes generation %s (%s @ %s): "
                        "result delivered, not cached under that key", req.request_id, ev.cache_key, own.gen_id,
                        own.model, own.model_revision)
        with self.telemetry.use(it.span):
            if it.error is not None:
                self.telemetry.requests_done.labels("infer", "error", it.error.code.value).inc()
                result = ResultEvent(status="error", error=ErrorInfo(code=it.error.code, message=it.error.message), **common)
                log.info("infer: %s[%d]@%d request %s failed: %s", it.record.topic, it.record.partition,
                         it.record.offset, req.request_id, it.error)
            else:
                pages = [Page(index=i + 1, width=p.shape[1], height=p.shape[0]) for i, p in enumerate(it.pages)]
                self.telemetry.requests_done.labels("infer", "ok", "").inc()
                result = ResultEvent(status="ok", pages=pages, lines=it.lines, warnings=it.warnings, **common)
                log.info("infer: %s[%d]@%d request %s: %d lines, inference %.0f ms%s", it.record.topic,
                         it.record.partition, it.record.offset, req.request_id, len(it.lines),
                         it.timings.get("inference", 0.0), f" ({', '.join(it.warnings)})" if it.warnings else "")
            headers = self.telemetry.inject(it.record.headers)
        if it.span is not None:
            if it.error is not None:
                it.span.set_status(StatusCode.ERROR, it.error.code.value)
            it.span.end()
        return Outgoing(self.s.topics.results, req.content_sha256, dumps(result), headers)

    def _generation(self, task: str) -> CacheGeneration:
        """This process's cache generation for ``task`` (settings are fixed: remembered per task)."""
        gen = self._gens.get(task)
        if gen is None:
            gen = self._gens[task] = self.s.generation(task)
        return gen

    def poison(self, record: ConsumerRecord, exc: BaseException, attempts: int) -> list[Outgoing]:
        """DLQ the event and fail its request (and, through the sink, the requests waiting on its key)."""
        try:
            ev = loads(InferEvent, record.value)
        except (ValueError, ValidationError):
            ev = None
        return poison_messages(stage="infer", topics=self.s.topics, record=record, exc=exc, attempts=attempts,
                               request=ev.request if ev else None, cache_key=ev.cache_key if ev else None)

    async def close(self) -> None:
        """Release the engine and drop prefetched images."""
        for task in self._prefetched.values():
            task.cancel()
        self._prefetched.clear()
        await self.engine.close()
