"""Infer logic: a micro-batch of ``ocr.infer`` events -> fetch, decode, tile, engine -> ``ocr.results``.

Memory: decoded pages live in shared memory written by decoder processes and are held within the
process's pixel budget (``pixel_budget_mb``, :mod:`services.infer.loading`): a micro-batch whose
pages do not fit goes through the engine in parts, so the pixels held at once stay under the
budget (or one image's, when a single image is larger) whatever the mix of images. The raw bytes
of at most ``2 x max_batch`` records are held besides (this batch and the prefetched next, each
at most ``limits.max_image_bytes``), and each decoder process at most ``decode.memory_mb``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import numpy as np

from schemas.errors import ErrorCode
from schemas.events import ErrorInfo, InferEvent, Line, LineSegment, Page, ResultEvent
from schemas.keys import CacheGeneration, split_cache_key
from services.common.dlq import oversized_result, poison_messages
from services.common.errors import OcrError
from services.common.events import dumps
from services.common.decoding import DecoderPool
from services.common.handler import Handler, Outgoing, Record
from services.common.s3 import ObjectStore
from services.common.telemetry import StatusCode, Telemetry
from services.common.textlines import group_lines
from schemas.tasks import TASKS, TaskParams, task_variant
from services.infer.engines.base import (EngineOutput, EngineTask, EngineTimeout, EngineUnavailable, OcrEngine,
                                          UnparsableOutput, UnsupportedTask)
from services.infer.loading import Item, Loader
from services.infer.settings import InferSettings
from services.infer.tiles import Tile, make_tiles, map_back

log = logging.getLogger(__name__)

CRASH_MEMORY = 10_000
"""Content hashes :class:`InferHandler` remembers as suspects, and as convicted (each at most)."""
CRASH_MEMORY_S = 3600.0
"""Seconds a convicted image's copies fail at once with ``engine_crash`` (then it is read again)."""


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


def item_task(it: Item) -> EngineTask:
    """The engine task of ``it``'s request (``RequestEvent.task`` and ``task_params``)."""
    req = it.event.request
    return EngineTask(req.task, req.task_params)


def engine_error(it: Item, exc: BaseException) -> OcrError:
    """The error an image's engine exception ends its request with. :class:`UnsupportedTask`
    (``unsupported_task``) and :class:`UnparsableOutput` (``unparsable_output``, its raw answer
    kept in ``it.raw_output`` and its warnings in ``it.warnings``) are final, as are timeouts,
    ``image_too_large`` (a MemoryError: deterministic) and ``engine_error``: none is retried."""
    if isinstance(exc, UnsupportedTask):
        return OcrError(ErrorCode.UNSUPPORTED_TASK, str(exc))
    if isinstance(exc, UnparsableOutput):
        it.raw_output = exc.raw
        it.warnings.extend(w for w in exc.warnings if w not in it.warnings)
        return OcrError(ErrorCode.UNPARSABLE_OUTPUT, str(exc))
    code = (ErrorCode.TIMEOUT if isinstance(exc, EngineTimeout)
            else ErrorCode.IMAGE_TOO_LARGE if isinstance(exc, MemoryError)
            else ErrorCode.ENGINE_ERROR)
    return OcrError(code, str(exc) or type(exc).__name__)


def join_answers(answers: list, task: EngineTask) -> str | dict[str, str | None]:
    """A request's answer from its pages' answers (in page order): text answers joined with a
    blank line; ``extract``: each requested field the first page's value that is not None."""
    if task.name == "extract":
        fields = tuple(task.params.fields or ()) if task.params else ()
        out: dict[str, str | None] = dict.fromkeys(fields)
        for a in answers:
            for f in fields:
                if out[f] is None and isinstance(a, dict):
                    out[f] = a.get(f)
        return out
    return "\n\n".join(a for a in answers if isinstance(a, str) and a)


class InferHandler(Handler):
    """Runs one micro-batch: S3 gets in parallel, decoding in threads, every tile of every page
    of the batch submitted to the engine at once, then one result per request.

    A failing image (bad data, timeout, engine error) gets an error result; the rest of the
    batch goes on. A store outage raises (the runner retries the batch with backoff).

    Time limit: ``limits.infer_timeout_s`` is one deadline per request, over all its tiles and
    pages together (see :meth:`_engine_request`), not per tile or page: a 20-page TIFF gets the
    same time as a one-page PNG. A request past its deadline gets a ``timeout`` result and its
    unfinished pieces are cancelled; the others in the batch go on.

    Memory: decoded pixels are held within ``pixel_budget_mb`` (module docstring); a batch over
    it goes through the engine in parts (:meth:`Loader.waves`).

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

    def __init__(self, settings: InferSettings, store: ObjectStore, engine: OcrEngine, telemetry: Telemetry,
                 decoder: DecoderPool | None = None):
        """Keep the collaborators; nothing is started or fetched until the runner calls in.

        Args:
            settings: The infer settings: ``limits`` (``max_image_bytes`` in bytes,
                ``max_pixels`` in pixels per page, ``max_pages``, ``infer_timeout_s`` in
                seconds per request), ``decode`` (decoder processes and their bounds),
                ``pixel_budget_mb``, ``fetch_concurrency`` (S3 gets in flight),
                ``tile_max_aspect``, ``topics`` and the generation fields.
            store: Where the images are read (``get_uri``).
            engine: A started :class:`OcrEngine`; closed by :meth:`close`.
            telemetry: Spans and counters of this process.
            decoder: The decoder processes (default: a pool from ``settings.decode``); closed by
                :meth:`close`.

        Raises:
            Nothing: the settings were validated when they were built.
        """
        self.s = settings
        self.store = store
        self.engine = engine
        self.telemetry = telemetry
        self.loader = Loader(settings, store, decoder or DecoderPool(settings.decode, settings.limits), telemetry)
        self._gens: dict[str, CacheGeneration] = {}  # task -> this process's generation
        # content SHA-256 -> lone reads during which the engine went away (see _infer); oldest first
        self._crashes: OrderedDict[str, int] = OrderedDict()
        self._convicted: dict[str, float] = {}  # content SHA-256 -> until when copies fail at once (monotonic s)

    def consumes(self) -> dict[str, type[InferEvent]]:
        """``ocr.infer`` -> :class:`InferEvent` (see :meth:`Handler.consumes`)."""
        return {self.s.topics.infer: InferEvent}

    async def undecodable(self, record: Record, exc: Exception) -> list[Outgoing]:
        """An event that does not decode goes to the DLQ at once as ``invalid_request`` (and fails
        its request when its id can be read); the rest of its batch goes on."""
        return self.poison(record, OcrError(ErrorCode.INVALID_REQUEST, str(exc)[:500]), 1)

    def oversize(self, msg: Outgoing, exc: BaseException, stub: Outgoing) -> list[Outgoing]:
        """A result too large for ``ocr.results`` also ends its request (and, through the sink, the
        copies waiting on its image) as ``input_too_large`` (:func:`~services.common.dlq.oversized_result`)."""
        return [stub, *oversized_result(msg, exc)]

    def prefetch(self, records: list[Record[InferEvent]]) -> None:
        """Start fetching the next batch's images, and decoding those that fit the pixel budget
        (:meth:`Loader.prefetch`); the runner hands over at most one batch ahead."""
        self.loader.prefetch(records)

    def forget(self, records: list[Record]) -> None:
        """Cancel the prefetches of ``records`` (their partitions were revoked; see :meth:`Handler.forget`)."""
        self.loader.forget(records)

    async def handle(self, records: list[Record[InferEvent]]) -> list[Outgoing]:
        """See :meth:`Handler.handle`: load every record, then the batch in waves that fit the
        pixel budget through the engine, then one result per request in record order. Each
        request's span runs from here to its result."""
        out: list[Outgoing] = []
        items = [Item(rec, rec.value, {"queue_infer": rec.queue_wait_ms()}, span=rec.span) for rec in records]
        try:
            # every load ends before a failure is raised: one still running would adopt its
            # prefetched pages after the release below, and their bytes would stay taken for good
            failed = [r for r in await asyncio.gather(*(self.loader.load(it) for it in items), return_exceptions=True)
                      if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
            async for wave in self.loader.waves([it for it in items if it.error is None]):
                await self._infer([it for it in wave if it.error is None])
                for it in wave:
                    it.release()
        finally:
            for it in items:
                it.release()
        for it in items:
            out.append(self._result(it))
            it.data = None
        return out

    async def _infer(self, items: list[Item]) -> None:
        """``items`` through the engine, with an image that takes the engine down isolated.

        The engine says when it went away *while it held* an image of the call
        (:attr:`EngineUnavailable.took_down`: the ``openai`` engine's connection carrying the
        image was dropped mid-exchange and the retry refused; a server that was already down
        refuses the first connection and counts for nothing). Then each image of that batch
        becomes a suspect: from then on, and before the rest of any batch, suspects are read one
        at a time, each after the engine answers a health check. A suspect read without trouble
        is cleared. One that took the engine down ``engine_crash_limit`` times while read alone
        (a batch of one counts as a lone read) ends with ``engine_crash`` instead of being
        retried for ever, so the next images go through; later copies of its bytes fail at once
        for :data:`CRASH_MEMORY_S` seconds (in this process). Every other outage is retried by
        the runner as before. Infer processes sharing one server count apart: an image read
        alone here while another process's image takes the server down is counted too (see
        README).

        Raises:
            EngineUnavailable: the engine is down or went away; the runner retries the batch.
        """
        limit = self.s.engine_crash_limit
        now = time.monotonic()
        rest: list[Item] = []
        suspects: list[Item] = []
        for it in items:
            sha = it.event.request.content_sha256
            until = self._convicted.get(sha)
            if until is not None and now >= until:
                del self._convicted[sha]
                until = None
            if until is not None:
                it.error = self._crash_error()
            elif sha in self._crashes:
                suspects.append(it)
            else:
                rest.append(it)
        for it in suspects:
            # Copies of one image (cache off, Redis down, two tasks) are suspects together: an
            # earlier copy may just have been convicted, or read through (no longer suspect).
            sha = it.event.request.content_sha256
            if sha in self._convicted:
                it.error = self._crash_error()
                continue
            if sha not in self._crashes:
                rest.append(it)
                continue
            if limit and self._crashes[sha] >= limit:
                del self._crashes[sha]
                self._convicted[sha] = now + CRASH_MEMORY_S
                while len(self._convicted) > CRASH_MEMORY:
                    self._convicted.pop(next(iter(self._convicted)))
                log.error("infer: %s took the OCR engine down %d times while read alone; ending it with engine_crash",
                          it.event.request.request_id, limit)
                it.error = self._crash_error()
                continue
            if not await self.engine.health():
                raise EngineUnavailable("the OCR engine does not answer its health check yet")
            await self._guarded([it])
        await self._guarded(rest)

    def _crash_error(self) -> OcrError:
        """``engine_crash`` for an image convicted of taking the engine down (:meth:`_infer`)."""
        return OcrError(ErrorCode.ENGINE_CRASH, f"the OCR engine went away {self.s.engine_crash_limit} times while "
                        "reading this image alone; not retried")

    async def _guarded(self, items: list[Item]) -> None:
        """:meth:`_infer_group`, noting which images were on the engine when it went away."""
        if not items:
            return
        try:
            await self._infer_group(items)
        except EngineUnavailable as exc:
            if exc.took_down:
                for it in items:
                    sha = it.event.request.content_sha256
                    n = self._crashes.pop(sha, 0) + (1 if len(items) == 1 else 0)
                    self._crashes[sha] = n
                    log.warning("infer: the OCR engine went away while reading %s%s (%d lone reads so far)",
                                it.event.request.request_id, "" if len(items) == 1 else f" in a batch of {len(items)}", n)
                while len(self._crashes) > CRASH_MEMORY:
                    self._crashes.popitem(last=False)
            raise
        for it in items:  # read through: no longer a suspect
            self._crashes.pop(it.event.request.content_sha256, None)

    async def _infer_group(self, items: list[Item]) -> None:
        """Every tile of every page of ``items`` through the engine at once (:meth:`_engine_batch`).

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
                task = item_task(it)
                if not self.engine.supports(task):  # final: no page goes to the engine
                    exc = self.engine.unsupported(task)
                    it.error = OcrError(ErrorCode.UNSUPPORTED_TASK, str(exc))
                    continue
                # text spotting slices long pages into tiles; the other tasks read each page whole
                aspect = self.s.tile_max_aspect if task.name == "ocr" else float("inf")
                for p, page in enumerate(it.pages):
                    for tile in make_tiles(page, aspect, self.engine.max_side):
                        jobs.append((it, p, tile))
            sp.set_attribute("ocrstream.tiles", len(jobs))
            t_engine = time.perf_counter()
            prep_ms = (t_engine - t0) * 1000
            outputs = await self._engine_batch(jobs)
            t1 = time.perf_counter()
            engine_ms = (t1 - t_engine) * 1000
            self.telemetry.engine_batch(self.engine.name, len(items), t1 - t_engine)
            per_page: dict[tuple[int, int], list] = {}
            answers: dict[int, list] = {}  # item -> its pages' answers (tasks other than ocr), in page order
            weight: dict[int, float] = {}
            for (it, p, tile), res in zip(jobs, outputs):
                if it.error is not None or res is None:
                    continue
                if isinstance(res, BaseException):
                    it.error = engine_error(it, res)
                    continue
                weight[id(it)] = weight.get(id(it), 0.0) + res.inference_ms
                it.warnings.extend(w for w in res.warnings if w not in it.warnings)
                if res.answer is not None:
                    answers.setdefault(id(it), []).append(res.answer)
                    continue
                h, w = it.pages[p].shape[:2]
                per_page.setdefault((id(it), p), []).extend(map_back(tile, res.segments, w, h))
            for it in items:
                if it.error is not None:
                    continue
                if it.event.request.task != "ocr":
                    it.answer = join_answers(answers.get(id(it), []), item_task(it))
                    continue
                lines = []
                for p in range(len(it.pages)):
                    for seg in group_lines(per_page.get((id(it), p), [])):
                        parts = [LineSegment(text=s.text.strip(), box=s.box,
                                             confidence=round(min(1.0, max(0.0, s.confidence)), 4)) for s in seg.parts]
                        lines.append(Line(text=seg.text, box=seg.box, confidence=round(seg.confidence, 4), page=p + 1,
                                          segments=parts))
                it.lines = lines
            post_ms = (time.perf_counter() - t1) * 1000
            total_w = sum(weight.get(id(it), 0.0) for it in items)
            for it in items:
                share = weight.get(id(it), 0.0) / total_w if total_w > 0 else 1 / len(items)
                it.timings["preprocess"] = prep_ms / len(items)
                it.timings["inference"] = engine_ms * share
                it.timings["postprocess"] = post_ms / len(items)

    async def _engine_batch(self, jobs: list[tuple[Item, int, Tile]]) -> list[EngineOutput | BaseException | None]:
        """Run every job's tile on the engine, all submitted at once, each request under its own deadline.

        Each tile is its own ``engine.ocr`` call (the engines run concurrent calls as they run
        the images of one call: vLLM batches them, RapidOCR queues them for its workers in
        submission order), so one request's pieces can be cancelled without touching the others.

        Returns:
            One entry per job, in order: the tile's :class:`EngineOutput`, the exception it
            ended with (:class:`EngineTimeout` when its request ran past its deadline), or None
            when it was cancelled because another piece of its request had already failed.

        Raises:
            Whatever ``engine.ocr`` raises (an engine that is down): the runner retries the batch.
        """
        timeout = self.s.limits.infer_timeout_s
        tasks = [asyncio.ensure_future(self._engine_piece(tile.image, item_task(it), timeout)) for it, _, tile in jobs]
        by_item: dict[int, list[int]] = {}
        for j, (it, _, _) in enumerate(jobs):
            by_item.setdefault(id(it), []).append(j)
        try:
            per_item = await asyncio.gather(*(self._engine_request([tasks[j] for j in js], timeout)
                                               for js in by_item.values()))
        finally:
            for t in tasks:  # no "exception never retrieved" for pieces no request waited for
                t.cancel()
                t.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
        outputs: list[EngineOutput | BaseException | None] = [None] * len(jobs)
        for js, results in zip(by_item.values(), per_item):
            for j, res in zip(js, results):
                outputs[j] = res
        return outputs

    async def _engine_piece(self, image: np.ndarray, task: EngineTask,
                            timeout_s: float) -> tuple[EngineOutput | BaseException, float]:
        """One tile (or page) through the engine for ``task``: its output (or exception) and when
        it came back (``time.monotonic``, s)."""
        [res] = await self.engine.ocr([image], task, timeout_s)
        return res, time.monotonic()

    @staticmethod
    async def _engine_request(tasks: list[asyncio.Task], timeout_s: float) -> list[EngineOutput | BaseException | None]:
        """Wait for one request's pieces (tiles of all its pages) under one deadline.

        The deadline is ``timeout_s`` after the request's work started on the engine: the
        earliest start (return time minus ``inference_ms``) of its pieces that have come back,
        so time spent queued behind other requests for an engine worker does not count, time
        spent on its own earlier pieces does. Until its first piece comes back, the engine's
        own per-piece limit (the same ``timeout_s``) bounds it. When the deadline passes, the
        unfinished pieces are cancelled and answered with :class:`EngineTimeout`; when a piece
        fails (an exception result), the rest are cancelled (None).

        Args:
            tasks: :meth:`_engine_piece` tasks of one request, in page and tile order.
            timeout_s: The request's time limit in seconds (``limits.infer_timeout_s``).

        Returns:
            One entry per task, in order (see :meth:`_engine_batch`).
        """
        results: dict[asyncio.Task, EngineOutput | BaseException | None] = {}
        pending = set(tasks)
        started: float | None = None  # time.monotonic() when the request's first piece started
        expired = failed = False
        while pending and not (expired or failed):
            wait = None if started is None else started + timeout_s - time.monotonic()
            done: set[asyncio.Task] = set()
            if wait is None or wait > 0:
                done, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                expired = True
                break
            for t in done:
                res, ended = t.result()
                results[t] = res
                if isinstance(res, BaseException):
                    failed = True
                else:
                    began = ended - res.inference_ms / 1000
                    started = began if started is None else min(started, began)
                    if ended - started > timeout_s:
                        expired = True
        for t in pending:
            t.cancel()
            t.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)  # no "never retrieved"
        if expired:
            late = EngineTimeout(f"the request's tiles and pages took longer than {timeout_s:g} s in all")
            return [late if not isinstance(results.get(t), BaseException) else results[t] for t in tasks]
        return [results.get(t) for t in tasks]

    def _result(self, it: Item) -> Outgoing:
        ev, req = it.event, it.event.request
        # The record's whole stay in this stage (Kafka timestamp -> now) = queue + own work +
        # waiting on the rest of the batch. Prefetched images were fetched and decoded while
        # still "queued", so the queue share is what the work does not explain.
        stay = max(0.0, time.time() * 1000 - it.record.timestamp_ms)
        work = sum(it.timings.get(k, 0.0) for k in ("fetch", "decode", "preprocess", "inference", "postprocess"))
        it.timings["queue_infer"] = min(it.timings.get("queue_infer", 0.0), max(0.0, stay - work))
        it.timings["batch_wait"] = max(0.0, stay - work - it.timings["queue_infer"])
        timings = dict(req.timings_ms, **{k: round(v, 3) for k, v in it.timings.items()})
        own = self._generation(req.task, req.task_params)
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
        with it.record.traced() as span:  # the request's span ends with its result
            if it.error is not None:
                self.telemetry.requests_done.labels("infer", "error", it.error.code.value).inc()
                result = ResultEvent(status="error", error=ErrorInfo(code=it.error.code, message=it.error.message),
                                     raw_output=it.raw_output, warnings=it.warnings, **common)
                log.info("infer: %s[%d]@%d request %s failed: %s", it.record.topic, it.record.partition,
                         it.record.offset, req.request_id, it.error)
            else:
                backgrounds = it.backgrounds or (None,) * len(it.page_sizes)
                pages = [Page(index=i + 1, width=w, height=h, alpha_background=bg)
                         for i, ((w, h), bg) in enumerate(zip(it.page_sizes, backgrounds))]
                self.telemetry.requests_done.labels("infer", "ok", "").inc()
                slot = {TASKS[req.task].slot: it.answer} if req.task != "ocr" and req.task in TASKS else {}
                result = ResultEvent(status="ok", pages=pages, lines=it.lines, warnings=it.warnings, **slot, **common)
                log.info("infer: %s[%d]@%d request %s: %d lines, inference %.0f ms%s", it.record.topic,
                         it.record.partition, it.record.offset, req.request_id, len(it.lines),
                         it.timings.get("inference", 0.0), f" ({', '.join(it.warnings)})" if it.warnings else "")
            headers = it.record.trace_headers()
            if it.error is not None and span is not None:
                span.set_status(StatusCode.ERROR, it.error.code.value)
        return Outgoing(self.s.topics.results, req.content_sha256, dumps(result), headers)

    def _generation(self, task: str, params: TaskParams | None = None) -> CacheGeneration:
        """This process's cache generation for ``task`` with ``params`` (settings are fixed:
        remembered per task variant, :func:`schemas.tasks.task_variant`)."""
        variant = task_variant(task, params)
        gen = self._gens.get(variant)
        if gen is None:
            gen = self._gens[variant] = self.s.generation(task, params)
        return gen

    def poison(self, record: Record, exc: BaseException, attempts: int) -> list[Outgoing]:
        """DLQ the event and fail its request (and, through the sink, the requests waiting on its key)."""
        ev = record.value if isinstance(record.value, InferEvent) else None
        return poison_messages(stage="infer", topics=self.s.topics, record=record, exc=exc, attempts=attempts,
                               request=ev.request if ev else None, cache_key=ev.cache_key if ev else None)

    async def close(self) -> None:
        """Release the engine, drop prefetched images and stop the decoder processes."""
        await self.loader.close()
        await self.engine.close()
