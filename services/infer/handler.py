"""Infer logic: a micro-batch of ``ocr.infer`` events -> fetch, decode, tile, engine -> ``ocr.results``."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np
from aiokafka import ConsumerRecord
from pydantic import ValidationError

from schemas.errors import ErrorCode
from schemas.events import ErrorInfo, InferEvent, Line, Page, ResultEvent
from services.common.dlq import poison_messages
from services.common.errors import OcrError
from services.common.events import dumps, loads, queue_wait_ms
from services.common.imaging import decode
from services.common.kafka import Outgoing
from services.common.runner import Handler
from services.common.s3 import ObjectStore
from services.common.telemetry import Telemetry
from services.common.textlines import group_lines
from services.infer.engines.base import EngineTimeout, OcrEngine
from services.infer.settings import InferSettings
from services.infer.tiles import make_tiles, map_back

log = logging.getLogger(__name__)


@dataclass
class _Item:
    record: ConsumerRecord
    event: InferEvent
    timings: dict[str, float] = field(default_factory=dict)
    pages: list[np.ndarray] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)
    error: OcrError | None = None


class InferHandler(Handler):
    """Runs one micro-batch: S3 gets in parallel, decoding in threads, one engine call for all
    tiles of all pages in the batch, then one result per request.

    A failing image (bad data, timeout, engine error) gets an error result; the rest of the
    batch goes on. A store outage raises (the runner retries the batch with backoff).
    """

    def __init__(self, settings: InferSettings, store: ObjectStore, engine: OcrEngine, telemetry: Telemetry):
        self.s = settings
        self.store = store
        self.engine = engine
        self.telemetry = telemetry
        self._fetch_sem = asyncio.Semaphore(settings.fetch_concurrency)

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
            items.append(_Item(rec, ev, {"queue_infer": queue_wait_ms(rec)}))
        await asyncio.gather(*(self._load(it) for it in items))
        await self._infer([it for it in items if it.error is None])
        for it in items:
            out.append(self._result(it))
        return out

    async def _load(self, it: _Item) -> None:
        limits = self.s.limits
        try:
            async with self._fetch_sem:
                t0 = time.perf_counter()
                data = await self.store.get_uri(it.event.request.image_uri, max_bytes=limits.max_image_bytes)
            t1 = time.perf_counter()
            it.timings["fetch"] = (t1 - t0) * 1000
            it.pages = await asyncio.to_thread(decode, data, limits.max_pixels, limits.max_pages)
            it.timings["decode"] = (time.perf_counter() - t1) * 1000
        except OcrError as err:
            if err.code == ErrorCode.MISSING_OBJECT:
                log.warning("infer: %s: %s", it.event.request.request_id, err)
            it.error = err

    async def _infer(self, items: list[_Item]) -> None:
        if not items:
            return
        t0 = time.perf_counter()
        jobs = []  # (item, page index, tile)
        for it in items:
            for p, page in enumerate(it.pages):
                for tile in make_tiles(page, self.s.tile_max_aspect, self.engine.max_side):
                    jobs.append((it, p, tile))
        prep_ms = (time.perf_counter() - t0) * 1000
        outputs = await self.engine.ocr([t.image for _, _, t in jobs], self.s.limits.infer_timeout_s)
        self.telemetry.engine_images.labels(self.engine.name).inc(len(items))
        t1 = time.perf_counter()
        per_page: dict[tuple[int, int], list] = {}
        for (it, p, tile), res in zip(jobs, outputs):
            if it.error is not None:
                continue
            if isinstance(res, BaseException):
                code = ErrorCode.TIMEOUT if isinstance(res, EngineTimeout) else ErrorCode.ENGINE_ERROR
                it.error = OcrError(code, str(res) or type(res).__name__)
                continue
            it.timings["inference"] = it.timings.get("inference", 0.0) + res.inference_ms
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
        for it in items:
            it.timings["preprocess"] = prep_ms / len(items)
            it.timings["postprocess"] = post_ms / len(items)

    def _result(self, it: _Item) -> Outgoing:
        ev, req = it.event, it.event.request
        timings = dict(req.timings_ms, **{k: round(v, 3) for k, v in it.timings.items()})
        common = dict(
            request=req.model_copy(update={"timings_ms": timings}), cache_key=ev.cache_key,
            engine=self.s.engine.engine, model=self.s.engine.model,
            model_revision=self.s.engine.model_revision, attempt=ev.attempt,
        )
        if it.error is not None:
            self.telemetry.requests_done.labels("infer", "error", it.error.code.value).inc()
            result = ResultEvent(status="error", error=ErrorInfo(code=it.error.code, message=it.error.message), **common)
        else:
            pages = [Page(index=i + 1, width=p.shape[1], height=p.shape[0]) for i, p in enumerate(it.pages)]
            self.telemetry.requests_done.labels("infer", "ok", "").inc()
            result = ResultEvent(status="ok", pages=pages, lines=it.lines, **common)
        return Outgoing(self.s.topics.results, req.content_sha256, dumps(result), list(it.record.headers or []))

    def poison(self, record: ConsumerRecord, exc: BaseException, attempts: int) -> list[Outgoing]:
        """DLQ the event and fail its request."""
        return poison_messages(stage="infer", topics=self.s.topics, record=record, exc=exc, attempts=attempts)

    async def close(self) -> None:
        """Release the engine."""
        await self.engine.close()
