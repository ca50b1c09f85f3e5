"""Getting a record's image into memory: S3 get, plan, pixel budget, decode in a worker.

Each record of ``ocr.infer`` (or ``ocr.infer-interactive``) becomes an :class:`Item`. Loading
it is two steps, both per item, so every record of the infer window loads on its own:

1. :meth:`Loader.fetch_plan`: the image's bytes from S3 and its plan (format check and every
   page's size, from the headers, in a decoder process: :class:`~services.common.images.decoding.DecoderPool`);
2. :meth:`Loader.decoded`: the item's pixel bytes taken from the process's
   :class:`~services.common.images.pixel_budget.PixelBudget` (``pixel_budget_mb``; an interactive page
   waits only behind other interactive pages), the pages decoded into shared memory, and given
   back when the block ends. An image larger than the whole budget runs alone. So the pixels in
   flight stay under the budget however many records the window holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from schemas.errors import ErrorCode
from schemas.events import InferEvent
from schemas.lanes import Priority
from schemas.reading import Line
from services.common.images.decoding import DecodedPages, DecoderPool, Plan
from services.common.images.pixel_budget import Hold, PixelBudget
from services.common.errors import OcrError
from services.common.records import Record
from services.common.s3 import ObjectStore
from services.common.telemetry import Span, Telemetry, record_attrs
from services.infer.settings import InferSettings


@dataclass
class Item:
    """One request in the infer window: its record and event, and what loading and inference made of it."""

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
    lane: Priority = "bulk"  # interactive: waits for pixels and engine slots only behind interactive records

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


def _load_span(fn):
    """Run a loading step of ``it`` in an ``infer.load`` span of the request's trace."""

    @functools.wraps(fn)
    async def wrapper(self: "Loader", it: Item):
        with self.telemetry.span("infer.load", parent_headers=it.record.headers, attributes=record_attrs(it.record)):
            return await fn(self, it)

    return wrapper


class Loader:
    """Fetches, plans and decodes the images of the infer window's records (module docstring).

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

    @contextlib.asynccontextmanager
    async def decoded(self, it: Item) -> AsyncIterator[Item]:
        """``async with loader.decoded(it):`` ``it``'s pages decoded and held within the budget
        for the block (planned ``it`` without error); a decoding error is kept in ``it.error``.
        The wait for room counts as ``engine_wait`` ms; an interactive item waits only behind
        other interactive ones."""
        t0 = time.perf_counter()
        await self.budget.acquire(it.plan.nbytes, urgent=it.lane == "interactive")
        it.timings["engine_wait"] = it.timings.get("engine_wait", 0.0) + (time.perf_counter() - t0) * 1000
        hold = Hold(self.budget, it.plan.nbytes)
        try:
            await self._decode(it, hold)
            yield it
        finally:
            it.release()
            hold.release()

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

    async def close(self) -> None:
        """Stop the decoder processes."""
        await self.decoder.close()
