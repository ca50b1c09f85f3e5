"""Infer logic: one ``ocr.infer`` (or ``ocr.infer-interactive``) record -> fetch, decode, tile,
engine -> its result on ``ocr.results``. The window runner (:mod:`services.infer.window`) keeps
many records in flight at once and produces each result the moment it is made.

Memory: decoded pages live in shared memory written by decoder processes and are held within the
process's pixel budget (``pixel_budget_mb``, :mod:`services.infer.loading`): a record whose
pages do not fit waits for room, so the pixels held at once stay under the budget (or one
image's, when a single image is larger) however many records are in flight. The raw bytes of at
most ``max_in_flight`` records are held besides (each at most ``limits.max_image_bytes``), and
each decoder process at most ``decode.memory_mb``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

import numpy as np

from schemas.errors import ErrorCode
from schemas.events import InferEvent, ResultEvent
from schemas.keys import CacheGeneration, split_cache_key
from schemas.lanes import Priority
from schemas.reading import ErrorInfo, Line, LineSegment, Page
from services.common.dlq import oversized_result, poison_messages
from services.common.errors import OcrError
from services.common.codec import dumps
from services.common.images.decoding import DecoderPool
from services.common.handler import Outgoing, Record
from services.common.s3 import ObjectStore
from services.common.telemetry import StatusCode, Telemetry
from services.infer.textlines import group_lines
from schemas.tasks import TASKS, TaskParams, task_variant
from services.infer.engines.base import (EngineOutput, EngineTask, EngineTimeout, EngineUnavailable, OcrEngine,
                                          UnparsableOutput, UnsupportedTask)
from services.infer.loading import Item, Loader
from services.infer.settings import InferSettings
from services.infer.tiles import Tile, make_tiles, map_back
from services.infer.window import WindowHandler

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


class EngineGate:
    """The engine shared by every page in flight, or held by one alone.

    A suspect (an image during whose read the engine went away) is read with nothing else on
    the engine (:meth:`exclusive`), so a second crash is its own; every other page reads under
    :meth:`shared`. A waiting exclusive holder stops new shared ones, so it gets its turn as
    soon as the pages on the engine are done.
    """

    def __init__(self):
        self._cond = asyncio.Condition()
        self._shared = 0
        self._exclusive = False
        self._exclusive_waiting = 0

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        """``async with gate.shared():`` the engine, alongside other shared holders."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and not self._exclusive_waiting)
            self._shared += 1
        try:
            yield
        finally:
            async with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """``async with gate.exclusive():`` the engine alone (waits for the shared holders to finish)."""
        async with self._cond:
            self._exclusive_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            async with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class InferHandler(WindowHandler):
    """Reads one record at a time, many at once: S3 get, plan and decode within the pixel
    budget, every tile of every page on the engine at once, then the request's result.

    A failing image (bad data, timeout, engine error) gets an error result; other records are
    unaffected. A store or engine outage raises (the window runner reads the record again with
    backoff, committing nothing past it).

    Lanes: a record of ``ocr.infer-interactive`` is interactive, one of ``ocr.infer`` bulk; an
    interactive page waits for decoded-pixel room and for an engine slot only behind other
    interactive pages (:class:`~services.infer.engines.slots.PrioritySlots`), and a VLM engine
    passes the lane on as the request's priority.

    Time limit: ``limits.infer_timeout_s`` is one deadline per request, over all its tiles and
    pages together (see :meth:`_engine_request`), not per tile or page: a 20-page TIFF gets the
    same time as a one-page PNG. A request past its deadline gets a ``timeout`` result and its
    unfinished pieces are cancelled.

    Generation check (rolling upgrades): dedup put its own generation in the event's cache key;
    when this process's generation (:meth:`CacheKeySettings.generation`: engine, model, revision,
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
        self.gate = EngineGate()
        self._gens: dict[str, CacheGeneration] = {}  # task -> this process's generation
        # content SHA-256 -> lone reads during which the engine went away (see _infer); oldest first
        self._crashes: OrderedDict[str, int] = OrderedDict()
        self._convicted: dict[str, float] = {}  # content SHA-256 -> until when copies fail at once (monotonic s)

    def consumes(self) -> dict[str, type[InferEvent]]:
        """``ocr.infer-interactive`` and ``ocr.infer`` -> :class:`InferEvent` (see :meth:`Handler.consumes`)."""
        return {self.s.topics.infer_interactive: InferEvent, self.s.topics.infer: InferEvent}

    def lane(self, topic: str) -> Priority:
        """``interactive`` for ``ocr.infer-interactive``, else ``bulk``."""
        return "interactive" if topic == self.s.topics.infer_interactive else "bulk"

    async def undecodable(self, record: Record, exc: Exception) -> list[Outgoing]:
        """An event that does not decode goes to the DLQ at once as ``invalid_request`` (and fails
        its request when its id can be read)."""
        return self.poison(record, OcrError(ErrorCode.INVALID_REQUEST, str(exc)[:500]), 1)

    def oversize(self, msg: Outgoing, exc: BaseException, stub: Outgoing) -> list[Outgoing]:
        """A result too large for ``ocr.results`` also ends its request (and, through the sink, the
        copies waiting on its image) as ``input_too_large`` (:func:`~services.common.dlq.oversized_result`)."""
        return [stub, *oversized_result(msg, exc)]

    async def handle_record(self, record: Record[InferEvent]) -> list[Outgoing]:
        """See :meth:`WindowHandler.handle_record`: load the image, decode it within the pixel
        budget, run it through the engine, and return its one result. The request's span runs
        from here to its result.

        Raises:
            OcrError: ``missing_object`` (the image is not in S3; tried again, then the DLQ).
            EngineUnavailable: the engine is down (retried as an outage).
        """
        it = Item(record, record.value, {"queue_infer": record.queue_wait_ms()}, span=record.span,
                  lane=self.lane(record.topic))
        try:
            await self.loader.fetch_plan(it)
            if it.error is None:
                async with self.loader.decoded(it):
                    if it.error is None:
                        await self._infer(it)
        finally:
            it.release()
        out = [self._result(it)]
        it.data = None
        return out

    async def _infer(self, it: Item) -> None:
        """``it`` through the engine, an image that takes the engine down isolated.

        The engine says when it went away *while it held* this image
        (:attr:`EngineUnavailable.took_down`: the ``openai`` engine's connection carrying the
        image was dropped mid-exchange and the retry refused; a server that was already down
        refuses the first connection and counts for nothing). Then the image becomes a suspect:
        from then on its copies are read alone (:meth:`EngineGate.exclusive`: nothing else on
        the engine), each after the engine answers a health check. A suspect read without
        trouble is cleared. One that took the engine down ``engine_crash_limit`` times while read
        alone ends with ``engine_crash`` instead of being retried for ever, so the next images go
        through; later copies of its bytes fail at once for :data:`CRASH_MEMORY_S` seconds (in
        this process). Every other outage is retried by the window runner. Infer processes
        sharing one server count apart: an image read alone here while another process's image
        takes the server down is counted too (docs/engines.md).

        Raises:
            EngineUnavailable: the engine is down or went away; the runner reads the record again.
        """
        sha = it.event.request.content_sha256
        if self._convicted_now(sha):
            it.error = self._crash_error()
            return
        if sha in self._crashes:
            async with self.gate.exclusive():
                # another copy may have been convicted or read through while this one waited
                if self._convicted_now(sha):
                    it.error = self._crash_error()
                    return
                if sha in self._crashes:
                    limit = self.s.engine_crash_limit
                    if limit and self._crashes[sha] >= limit:
                        self._convict(it, sha, limit)
                        return
                    if not await self.engine.health():
                        raise EngineUnavailable("the OCR engine does not answer its health check yet")
                    await self._guarded(it, alone=True)
                    return
        async with self.gate.shared():
            await self._guarded(it, alone=False)

    def _convicted_now(self, sha: str) -> bool:
        """Whether copies of ``sha`` fail at once now (a conviction past its time is dropped)."""
        until = self._convicted.get(sha)
        if until is not None and time.monotonic() >= until:
            del self._convicted[sha]
            until = None
        return until is not None

    def _convict(self, it: Item, sha: str, limit: int) -> None:
        """``sha`` took the engine down ``limit`` times read alone: ``engine_crash`` for this
        copy and, for :data:`CRASH_MEMORY_S`, for every later one."""
        del self._crashes[sha]
        self._convicted[sha] = time.monotonic() + CRASH_MEMORY_S
        while len(self._convicted) > CRASH_MEMORY:
            self._convicted.pop(next(iter(self._convicted)))
        log.error("infer: %s took the OCR engine down %d times while read alone; ending it with engine_crash",
                  it.event.request.request_id, limit)
        it.error = self._crash_error()

    def _crash_error(self) -> OcrError:
        """``engine_crash`` for an image convicted of taking the engine down (:meth:`_infer`)."""
        return OcrError(ErrorCode.ENGINE_CRASH, f"the OCR engine went away {self.s.engine_crash_limit} times while "
                        "reading this image alone; not retried")

    async def _guarded(self, it: Item, alone: bool) -> None:
        """:meth:`_infer_item`, noting when the engine went away while it held ``it`` (a lone
        read counts against the image; a read beside others makes it a suspect)."""
        sha = it.event.request.content_sha256
        try:
            await self._infer_item(it)
        except EngineUnavailable as exc:
            if exc.took_down:
                n = self._crashes.pop(sha, 0) + (1 if alone else 0)
                self._crashes[sha] = n
                log.warning("infer: the OCR engine went away while reading %s%s (%d lone reads so far)",
                            it.event.request.request_id, "" if alone else " beside other pages", n)
                while len(self._crashes) > CRASH_MEMORY:
                    self._crashes.popitem(last=False)
            raise
        self._crashes.pop(sha, None)  # read through: no longer a suspect

    async def _infer_item(self, it: Item) -> None:
        """Every tile of every page of ``it`` through the engine at once, under one deadline,
        then its lines (task ``ocr``) or its answer.

        Timings: ``preprocess`` (tiling), ``engine_wait`` (until its first piece got an engine
        slot), ``inference`` (from then until its last piece came back), ``postprocess`` (line
        grouping).
        """
        task = item_task(it)
        if not self.engine.supports(task):  # final: no page goes to the engine
            it.error = OcrError(ErrorCode.UNSUPPORTED_TASK, str(self.engine.unsupported(task)))
            return
        with self.telemetry.use(it.span), self.telemetry.span(
                "infer.engine", attributes={"ocrstream.engine": self.engine.name, "ocrstream.lane": it.lane}) as sp:
            t0 = time.perf_counter()
            # text spotting slices long pages into tiles; the other tasks read each page whole
            aspect = self.s.tile_max_aspect if task.name == "ocr" else float("inf")
            shrink = not self.engine.shrinks_large_pages
            jobs = [(p, tile) for p, page in enumerate(it.pages)
                    for tile in make_tiles(page, aspect, self.engine.max_side, downscale=shrink)]
            sp.set_attribute("ocrstream.tiles", len(jobs))
            t_engine = time.perf_counter()
            outputs, first_start = await self._engine_request([tile.image for _, tile in jobs], task, it.lane)
            t1 = time.perf_counter()
            self.telemetry.engine_request(self.engine.name, t1 - t_engine)
            started = t_engine if first_start is None else max(t_engine, min(t1, first_start))
            it.timings["preprocess"] = (t_engine - t0) * 1000
            it.timings["engine_wait"] = it.timings.get("engine_wait", 0.0) + (started - t_engine) * 1000
            it.timings["inference"] = (t1 - started) * 1000
            self._collect(it, task, jobs, outputs)
            it.timings["postprocess"] = (time.perf_counter() - t1) * 1000

    def _collect(self, it: Item, task: EngineTask, jobs: list[tuple[int, Tile]],
                 outputs: list[EngineOutput | BaseException | None]) -> None:
        """``it``'s error, warnings and lines (task ``ocr``: its pieces' segments mapped back to
        page pixels and grouped into lines) or answer (every other task) from its pieces' outputs."""
        per_page: dict[int, list] = {}
        answers: list = []  # tasks other than ocr: the pages' answers, in page order
        for (p, tile), res in zip(jobs, outputs):
            if it.error is not None or res is None:
                continue
            if isinstance(res, BaseException):
                it.error = engine_error(it, res)
                continue
            it.warnings.extend(w for w in res.warnings if w not in it.warnings)
            if res.answer is not None:
                answers.append(res.answer)
                continue
            h, w = it.pages[p].shape[:2]
            per_page.setdefault(p, []).extend(map_back(tile, res.segments, w, h))
        if it.error is not None:
            return
        if task.name != "ocr":
            it.answer = join_answers(answers, task)
            return
        lines = []
        for p in range(len(it.pages)):
            for seg in group_lines(per_page.get(p, [])):
                parts = [LineSegment(text=s.text.strip(), box=s.box, confidence=round(min(1.0, max(0.0, s.confidence)), 4))
                         for s in seg.parts]
                lines.append(Line(text=seg.text, box=seg.box, confidence=round(seg.confidence, 4), page=p + 1,
                                  segments=parts))
        it.lines = lines

    async def _engine_piece(self, image: np.ndarray, task: EngineTask, timeout_s: float,
                            lane: Priority) -> tuple[EngineOutput | BaseException, float]:
        """One tile (or page) through the engine: its output (or the exception it ended with)
        and when it came back (``time.perf_counter``, s).

        Raises:
            EngineUnavailable: the engine is down (the whole record is read again).
        """
        try:
            res: EngineOutput | BaseException = await self.engine.page(image, task, timeout_s, lane)
        except EngineUnavailable:
            raise
        except Exception as exc:  # the piece's own failure: timeout, engine_error, unparsable_output, ...
            res = exc
        return res, time.perf_counter()

    async def _engine_request(self, images: list[np.ndarray], task: EngineTask,
                              lane: Priority) -> tuple[list[EngineOutput | BaseException | None], float | None]:
        """One request's pieces (tiles of all its pages) on the engine at once, under one deadline.

        The deadline is ``limits.infer_timeout_s`` after the request's work started on the
        engine: the earliest start (return time minus ``inference_ms``) of its pieces that have
        come back, so time spent waiting for an engine slot behind other requests does not
        count, time spent on its own earlier pieces does. Until its first piece comes back, the
        engine's own per-piece limit (the same time) bounds it. When the deadline passes, the
        unfinished pieces are cancelled and answered with :class:`EngineTimeout`; when a piece
        fails (an exception result), the rest are cancelled (None).

        Returns:
            One entry per image, in order (its output, its exception, or None when cancelled),
            and when the first piece started on the engine (``time.perf_counter``, s; None if
            none came back).

        Raises:
            EngineUnavailable: the engine is down (the unfinished pieces are cancelled).
        """
        timeout_s = self.s.limits.infer_timeout_s
        tasks = [asyncio.ensure_future(self._engine_piece(img, task, timeout_s, lane)) for img in images]
        results: dict[asyncio.Task, EngineOutput | BaseException | None] = {}
        pending = set(tasks)
        started: float | None = None  # time.perf_counter() when the request's first piece started
        expired = failed = False
        try:
            while pending and not (expired or failed):
                wait = None if started is None else started + timeout_s - time.perf_counter()
                done: set[asyncio.Task] = set()
                if wait is None or wait > 0:
                    done, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    expired = True
                    break
                for t in done:
                    res, ended = t.result()  # EngineUnavailable propagates
                    results[t] = res
                    if isinstance(res, BaseException):
                        failed = True
                    else:
                        began = ended - res.inference_ms / 1000
                        started = began if started is None else min(started, began)
                        if ended - started > timeout_s:
                            expired = True
        finally:
            for t in tasks:  # unfinished pieces (a deadline, a failure, an outage) are cancelled
                if not t.done():
                    t.cancel()
                t.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)  # no "never retrieved"
        if expired:
            late = EngineTimeout(f"the request's tiles and pages took longer than {timeout_s:g} s in all")
            return [late if not isinstance(results.get(t), BaseException) else results[t] for t in tasks], started
        return [results.get(t) for t in tasks], started

    def _result(self, it: Item) -> Outgoing:
        """The request's result event on ``ocr.results`` (ok or error), its span ended."""
        ev, req = it.event, it.event.request
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
