"""Getting a micro-batch's images into memory: S3 get, plan, pixel budget, decode in a worker.

Each record of ``ocr.infer`` becomes an :class:`Item`. Loading it is two steps:

1. :meth:`Loader.fetch_plan`: the image's bytes from S3 and its plan (format check and every
   page's size, from the headers, in a decoder process: :class:`~services.common.decoding.DecoderPool`);
2. :meth:`Loader.waves`: the batch's items in *waves* that fit the process's
   :class:`~services.common.decoding.PixelBudget` (``pixel_budget_mb``), each item's bytes taken
   before it is decoded and given back once the wave has been through the engine. A batch that
   fits is one wave; a batch of huge pages runs in parts; an image larger than the whole budget
   runs alone. So the pixels in flight stay under the budget whatever the mix of images.

Prefetching (:meth:`Loader.prefetch`, while the batch before is on the engine) does step 1 for
the next batch's records and decodes an item only when its bytes fit the budget at once. When the
batch in flight cannot get bytes for its next wave, the prefetched pages give theirs back first
(they are decoded again when their turn comes), so the batch in flight never waits on the next.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from schemas.errors import ErrorCode
from schemas.events import InferEvent, Line
from services.common.decoding import DecodedPages, DecoderPool, Plan
from services.common.pixel_budget import Hold, PixelBudget
from services.common.errors import OcrError
from services.common.records import Record
from services.common.s3 import ObjectStore
from services.common.telemetry import Span, Telemetry, record_attrs
from services.infer.settings import InferSettings


@dataclass
class Item:
    """One request of the batch: its record and event, and what loading and inference made of it."""

    record: Record[InferEvent]
    event: InferEvent
    timings: dict[str, float] = field(default_factory=dict)
    data: bytes | None = None  # the image's bytes, kept until the request's result is made
    plan: Plan | None = None
    decoded: DecodedPages | None = None
    backgrounds: tuple[str | None, ...] = ()  # per page, as decoded (kept after release)
    sizes: tuple[tuple[int, int], ...] = ()  # per page (width, height) as decoded (kept after release)
    lines: list[Line] = field(default_factory=list)
    answer: str | dict[str, str | None] | None = None  # a task other than ocr: its answer (all pages together)
    raw_output: str | None = None  # the model's answer when it was unparsable_output
    warnings: list[str] = field(default_factory=list)  # from the engine, once each, in order seen
    error: OcrError | None = None
    span: Span | None = None  # the request's ``infer`` span, ended with its result

    @property
    def pages(self) -> list[np.ndarray]:
        """The decoded pages, ``(height, width, 3)`` RGB ``uint8`` each; empty when not decoded."""
        return self.decoded.pages if self.decoded is not None else []

    @property
    def page_sizes(self) -> tuple[tuple[int, int], ...]:
        """Every page's upright ``(width, height)`` in pixels, as decoded (known after release)."""
        return self.sizes or (self.plan.sizes if self.plan is not None else ())

    def release(self) -> None:
        """Give the decoded pages' bytes back to the budget (idempotent)."""
        if self.decoded is not None:
            self.decoded.release()
            self.decoded = None

    def adopt(self, other: "Item") -> None:
        """Take over what a prefetch of the same record loaded."""
        self.data, self.plan, self.decoded, self.error = other.data, other.plan, other.decoded, other.error
        self.backgrounds, self.sizes = other.backgrounds, other.sizes
        self.timings.update(other.timings)
        other.decoded = None


def _load_span(fn):
    """Run a loading step of ``it`` in an ``infer.load`` span of the request's trace (prefetched or not)."""

    @functools.wraps(fn)
    async def wrapper(self: "Loader", it: Item):
        with self.telemetry.span("infer.load", parent_headers=it.record.headers, attributes=record_attrs(it.record)):
            return await fn(self, it)

    return wrapper


class Loader:
    """Fetches, plans and decodes the images of infer's micro-batches (module docstring).

    Args:
        settings: ``limits.max_image_bytes`` (bytes per image), ``fetch_concurrency`` (S3 gets in
            flight), ``pixel_budget_mb`` (MiB of decoded pixels held at once, 0 = unbounded).
        store: Where the images are read (``get_uri``).
        decoder: The decoder processes; closed by :meth:`close`.
        telemetry: Spans of this process.
    """

    def __init__(self, settings: InferSettings, store: ObjectStore, decoder: DecoderPool, telemetry: Telemetry):
        self.s = settings
        self.store = store
        self.decoder = decoder
        self.telemetry = telemetry
        self.budget = PixelBudget(settings.pixel_budget_mb << 20)
        telemetry.watch_pixel_budget(self.budget)
        self._fetch_sem = asyncio.Semaphore(settings.fetch_concurrency)
        # next batch's items, fetched (and decoded when they fit) while the current batch is on the engine
        self._prefetched: dict[tuple[str, int, int], asyncio.Task] = {}
        self._squeezing = False  # the batch in flight waits for bytes: prefetched pages give theirs back

    # -- prefetching ------------------------------------------------------------------------
    def prefetch(self, records: list[Record[InferEvent]]) -> None:
        """Start loading the next batch's images (the runner hands over at most one batch ahead,
        only records that decoded)."""
        for rec in records:
            if not isinstance(rec.value, InferEvent):
                continue  # did not decode: the runner sends it to the DLQ
            task = asyncio.ensure_future(self._prefetch_one(Item(rec, rec.value)))
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)  # no "never retrieved"
            self._prefetched[(rec.topic, rec.partition, rec.offset)] = task

    async def _prefetch_one(self, it: Item) -> Item:
        await self.fetch_plan(it)
        if it.error is None and not self._squeezing and self.budget.try_acquire(it.plan.nbytes):
            await self._decode(it, Hold(self.budget, it.plan.nbytes))
            if self._squeezing:
                it.release()
        return it

    def forget(self, records: list[Record]) -> None:
        """Cancel the prefetches of ``records`` (their partitions were revoked) and free their pages."""
        for rec in records:
            self._drop(self._prefetched.pop((rec.topic, rec.partition, rec.offset), None))

    @staticmethod
    def _drop(task: asyncio.Task | None) -> None:
        if task is None:
            return
        if task.done():
            if not task.cancelled() and task.exception() is None:
                task.result().release()
        else:
            task.cancel()

    def _squeeze(self) -> None:
        """Prefetched pages give their bytes back (kept: the bytes and the plan); decodes still
        running give theirs back when they end."""
        self._squeezing = True
        for task in self._prefetched.values():
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().release()

    # -- loading a batch --------------------------------------------------------------------
    async def load(self, it: Item) -> None:
        """Step 1 for ``it``: what its prefetch loaded, or :meth:`fetch_plan` now.

        Raises:
            OcrError: ``missing_object`` (the runner retries, then sends the record to the DLQ).
        """
        rec = it.record
        task = self._prefetched.pop((rec.topic, rec.partition, rec.offset), None)
        if task is not None:
            it.adopt(await task)
        else:
            await self.fetch_plan(it)

    @_load_span
    async def fetch_plan(self, it: Item) -> None:
        """The image's bytes (``fetch`` ms) and its plan (``decode`` ms); an input error is kept
        in ``it.error``.

        Raises:
            OcrError: ``missing_object`` only; every other error ends the request.
        """
        limits = self.s.limits
        try:
            async with self._fetch_sem:
                t0 = time.perf_counter()
                data = await self.store.get_uri(it.event.request.image_uri, max_bytes=limits.max_image_bytes)
            t1 = time.perf_counter()
            it.timings["fetch"] = (t1 - t0) * 1000
            it.plan = await self.decoder.plan(data)
            it.timings["decode"] = (time.perf_counter() - t1) * 1000
            it.data = data
        except OcrError as err:
            if err.code == ErrorCode.MISSING_OBJECT:
                raise  # retried a bounded number of times, then DLQ + error result (Handler.poison)
            it.error = err

    async def _decode(self, it: Item, hold: Hold) -> None:
        """Decode ``it`` into shared memory; ``hold`` is its ``plan.nbytes`` taken from the budget,
        given back when its pages are released (or at once when decoding fails)."""
        t0 = time.perf_counter()
        try:
            with self.telemetry.span("infer.load", parent_headers=it.record.headers, attributes=record_attrs(it.record)):
                it.decoded = await self.decoder.decode(it.data, it.plan, on_release=hold.release)
                it.backgrounds, it.sizes = it.decoded.backgrounds, it.decoded.sizes
        except OcrError as err:
            it.error = err
        finally:
            if it.decoded is None:
                hold.release()
        it.timings["decode"] = it.timings.get("decode", 0.0) + (time.perf_counter() - t0) * 1000

    async def waves(self, items: list[Item]) -> AsyncIterator[list[Item]]:
        """Yield ``items`` (planned, no error) in groups whose pages are decoded and held within
        the budget; the caller releases each group's pages before asking for the next.

        Each group holds the items already decoded (prefetched) and then, in order, as many of the
        rest as fit the budget now; when none fits, prefetched pages give their bytes back and the
        first waits for its own (it runs alone if it is larger than the whole budget).
        """
        rest = list(items)
        while rest:
            wave = [it for it in rest if it.decoded is not None]
            todo = [it for it in rest if it.decoded is None]
            taken: list[tuple[Item, Hold]] = []
            try:
                for it in todo:
                    if not self.budget.try_acquire(it.plan.nbytes):
                        break
                    taken.append((it, Hold(self.budget, it.plan.nbytes)))
                if not wave and not taken and todo:
                    self._squeeze()
                    try:
                        await self.budget.acquire(todo[0].plan.nbytes)
                    finally:
                        self._squeezing = False
                    taken.append((todo[0], Hold(self.budget, todo[0].plan.nbytes)))
                    for it in todo[1:]:
                        if not self.budget.try_acquire(it.plan.nbytes):
                            break
                        taken.append((it, Hold(self.budget, it.plan.nbytes)))
                # every decode ends before an error is raised: one still running would otherwise
                # take its pages after the caller released this batch's items
                done = await asyncio.gather(*(self._decode(it, hold) for it, hold in taken), return_exceptions=True)
                first = next((r for r in done if isinstance(r, BaseException)), None)
                if first is not None:
                    raise first
            except BaseException:
                for it, hold in taken:
                    if it.decoded is None:
                        hold.release()
                raise
            group = wave + [it for it, _ in taken]
            held = {id(it) for it in group}
            rest = [it for it in rest if id(it) not in held]
            yield group

    async def close(self) -> None:
        """Drop the prefetched images and stop the decoder processes."""
        for task in self._prefetched.values():
            self._drop(task)
        self._prefetched.clear()
        await self.decoder.close()
