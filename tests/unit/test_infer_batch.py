"""The infer handler's batch logic with a small in-memory engine and store (no Kafka, no S3)."""

from __future__ import annotations

import asyncio
import io

import orjson
import pytest
from aiokafka import ConsumerRecord
from PIL import Image

from schemas.errors import ErrorCode
from schemas.events import InferEvent, RequestEvent, ResultEvent
from services.common.errors import OcrError
from services.common.events import dumps
from services.common.records import Decoder, Record
from services.common.settings import Limits, TelemetrySettings
from services.common.telemetry import Telemetry
from services.common.textlines import Segment
from services.infer.engines.base import EngineOutput, EngineTimeout, EngineUnavailable, OcrEngine
from services.infer.handler import InferHandler
from services.infer.settings import InferSettings


class MemoryStore:
    """The two ObjectStore calls the handler makes, over a dict."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects

    async def get_uri(self, uri: str, max_bytes: int | None = None) -> bytes:
        if uri not in self.objects:
            raise OcrError(ErrorCode.MISSING_OBJECT, uri)
        return self.objects[uri]


class ScriptedEngine(OcrEngine):
    """Answers by image height: 111 -> timeout, 222 -> raises, else one segment spanning the image
    (333: flagged as cut at the token cap)."""

    name = "scripted"
    max_side = 1000

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    async def start(self) -> None:
        self.ready = True

    async def ocr(self, images, task, timeout_s):
        out = []
        for img in images:
            h, w = img.shape[:2]
            self.calls.append((h, w))
            if h == 111:
                out.append(EngineTimeout("too slow"))
            elif h == 222:
                out.append(RuntimeError("kaboom"))
            else:
                warnings = ("truncated_max_tokens",) if h == 333 else ()
                out.append(EngineOutput([Segment([[0, 0], [w, 0], [w, h], [0, h]], f"TEXT {h}x{w}", 0.9)], 5.0,
                                        warnings))
        return out


def png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), "white").save(buf, "PNG")
    return buf.getvalue()


DECODE = Decoder({"ocr.infer": InferEvent})  # as InferHandler.consumes


def record(i: int, uri: str) -> Record:
    ev = InferEvent(request=RequestEvent(request_id=f"r{i}", content_sha256=f"{i:064d}", image_uri=uri),
                    cache_key=f"abcdefabcdef:{i:064d}")
    return DECODE(ConsumerRecord("ocr.infer", 0, i, 0, 0, None, dumps(ev), None, 0, 0, []))


def run(objects: dict[str, bytes], uris: list[str]):
    engine = ScriptedEngine()
    handler = InferHandler(InferSettings(), MemoryStore(objects), engine, Telemetry("infer", TelemetrySettings()))
    out = asyncio.run(handle_and_close(handler, [record(i, u) for i, u in enumerate(uris)]))
    return [ResultEvent.model_validate(orjson.loads(o.value)) for o in out], engine


async def handle_and_close(handler: InferHandler, records: list[Record]):
    """One batch, then the handler closed (its decoder processes stopped)."""
    try:
        return await handler.handle(records)
    finally:
        await handler.close()


def test_one_slow_or_failing_image_does_not_fail_the_batch():
    objs = {"s3://b/ok": png(300, 100), "s3://b/slow": png(300, 111), "s3://b/bad": png(300, 222),
            "s3://b/junk": b"not an image"}
    results, engine = run(objs, ["s3://b/ok", "s3://b/slow", "s3://b/bad", "s3://b/junk", "s3://b/ok"])
    assert [r.status for r in results] == ["ok", "error", "error", "error", "ok"]
    assert [r.error.code for r in results[1:4]] == [ErrorCode.TIMEOUT, ErrorCode.ENGINE_ERROR,
                                                    ErrorCode.UNSUPPORTED_FORMAT]
    assert results[0].lines[0].text == "TEXT 100x300" and results[0].pages[0].width == 300
    assert len(engine.calls) == 4  # the undecodable image never reaches the engine
    assert {"fetch", "decode", "inference", "queue_infer"} <= set(results[0].request.timings_ms)


def test_large_pages_are_downscaled_for_the_engine_and_boxes_mapped_back():
    results, engine = run({"s3://b/big": png(2000, 1500)}, ["s3://b/big"])
    assert engine.calls == [(750, 1000)]  # max_side 1000
    assert results[0].lines[0].box == [[0, 0], [2000, 0], [2000, 1500], [0, 1500]]


def test_long_pages_are_sliced_and_every_tile_reaches_the_engine():
    results, engine = run({"s3://b/long": png(300, 5000)}, ["s3://b/long"])
    assert len(engine.calls) > 4 and all(h <= 1000 and w == 300 for h, w in engine.calls)
    assert results[0].status == "ok" and results[0].pages[0].height == 5000


def test_engine_warnings_reach_the_result_once():
    # a 2-page TIFF whose pages both come back flagged, next to a clean image
    buf = io.BytesIO()
    Image.new("RGB", (300, 333), "white").save(buf, "TIFF", save_all=True,
                                               append_images=[Image.new("RGB", (300, 333), "white")])
    results, _ = run({"s3://b/cut": buf.getvalue(), "s3://b/ok": png(300, 100)}, ["s3://b/cut", "s3://b/ok"])
    assert [r.status for r in results] == ["ok", "ok"]
    assert len(results[0].lines) == 2 and results[0].warnings == ["truncated_max_tokens"]
    assert results[1].warnings == []


def test_forget_cancels_the_prefetches_of_revoked_records():
    class BlockingStore(MemoryStore):
        async def get_uri(self, uri: str, max_bytes: int | None = None) -> bytes:
            await asyncio.Event().wait()  # never answers: the prefetch is still running when forgotten

    async def main():
        handler = InferHandler(InferSettings(), BlockingStore({}), ScriptedEngine(), Telemetry("infer", TelemetrySettings()))
        kept, gone = record(1, "s3://b/a"), record(2, "s3://b/b")
        handler.prefetch([kept, gone])
        tasks = dict(handler.loader._prefetched)
        handler.forget([gone])
        await asyncio.sleep(0)
        assert list(handler.loader._prefetched) == [("ocr.infer", 0, 1)]
        assert tasks[("ocr.infer", 0, 2)].cancelled() and not tasks[("ocr.infer", 0, 1)].done()
        await handler.close()

    asyncio.run(main())


class OneAtATimeEngine(OcrEngine):
    """One image at a time (like RapidOCR with one worker), each taking ``seconds``; an empty result."""

    name = "one-at-a-time"
    max_side = 1000

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started: list[tuple[int, int]] = []
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        self.ready = True

    async def ocr(self, images, task, timeout_s):
        out = []
        for img in images:
            async with self._lock:
                began = asyncio.get_running_loop().time()
                self.started.append(img.shape[:2])
                await asyncio.sleep(self.seconds)
                out.append(EngineOutput([], (asyncio.get_running_loop().time() - began) * 1000))
        return out


def test_the_time_limit_is_one_deadline_per_request_over_all_its_pages():
    # 3 pages of 0.6 x the limit each: 1.8 x the limit in all -> timeout, although each page
    # alone is well within it; the one-page image queued behind it still gets its full time.
    frames = [Image.new("RGB", (300, 100 + i), "white") for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, "TIFF", save_all=True, append_images=frames[1:])
    objs = {"s3://b/pages": buf.getvalue(), "s3://b/one": png(300, 50)}
    engine = OneAtATimeEngine(0.6)
    settings = InferSettings(limits=Limits(infer_timeout_s=1.0))
    handler = InferHandler(settings, MemoryStore(objs), engine, Telemetry("infer", TelemetrySettings()))
    out = asyncio.run(handle_and_close(handler, [record(0, "s3://b/pages"), record(1, "s3://b/one")]))
    results = [ResultEvent.model_validate(orjson.loads(o.value)) for o in out]
    assert [r.status for r in results] == ["error", "ok"]
    assert results[0].error.code is ErrorCode.TIMEOUT
    assert results[0].error.message == "the request's tiles and pages took longer than 1 s in all"
    assert results[1].pages[0].height == 50
    # page 3 never started: the request's deadline passed during page 2, which was cancelled
    assert engine.started == [(100, 300), (101, 300), (50, 300)]


class DownOnBatchEngine(ScriptedEngine):
    """Goes away (``took_down``) when a call carries two or more images; reads one image at a time."""

    async def health(self) -> bool:
        return True

    async def ocr(self, images, task, timeout_s):
        if len(images) > 1:
            raise EngineUnavailable("connection dropped", took_down=True)
        return await super().ocr(images, task, timeout_s)


def test_copies_of_one_suspect_image_in_a_batch_are_each_settled():
    """Two copies of a suspect (same content hash; cache off or Redis down) in one micro-batch: the
    first copy's lone read clears or convicts the image, and the second copy follows it."""
    sha = "a" * 64

    def copies() -> list[Record]:
        evs = [InferEvent(request=RequestEvent(request_id=f"c{i}", content_sha256=sha, image_uri="s3://b/x"),
                          cache_key=f"abcdefabcdef:{sha}") for i in range(2)]
        return [DECODE(ConsumerRecord("ocr.infer", 0, i, 0, 0, None, dumps(ev), None, 0, 0, [])) for i, ev in enumerate(evs)]

    # read through: the first copy's lone read clears it, the second is read (with the others)
    engine = DownOnBatchEngine()
    handler = InferHandler(InferSettings(), MemoryStore({"s3://b/x": png(300, 100)}), engine,
                           Telemetry("infer", TelemetrySettings()))
    handler._crashes[sha] = 1  # one lone crash so far
    out = asyncio.run(handle_and_close(handler, copies()))
    results = [ResultEvent.model_validate(orjson.loads(o.value)) for o in out]
    assert [r.status for r in results] == ["ok", "ok"]
    assert [r.lines[0].text for r in results] == ["TEXT 100x300"] * 2
    assert sha not in handler._crashes and sha not in handler._convicted

    # at the limit: the first copy is convicted, the second shares its engine_crash without a read
    engine = DownOnBatchEngine()
    handler = InferHandler(InferSettings(), MemoryStore({"s3://b/x": png(300, 100)}), engine,
                           Telemetry("infer", TelemetrySettings()))
    handler._crashes[sha] = InferSettings().engine_crash_limit
    out = asyncio.run(handle_and_close(handler, copies()))
    results = [ResultEvent.model_validate(orjson.loads(o.value)) for o in out]
    assert [r.error.code for r in results] == [ErrorCode.ENGINE_CRASH] * 2
    assert engine.calls == [] and sha in handler._convicted


class BudgetWatchingEngine(ScriptedEngine):
    """Records, at every call, the bytes of decoded pixels its handler holds."""

    def __init__(self):
        super().__init__()
        self.handler: InferHandler | None = None
        self.held: list[int] = []

    async def ocr(self, images, task, timeout_s):
        self.held.append(self.handler.loader.budget.used)
        return await super().ocr(images, task, timeout_s)


def budget_run(objs: dict[str, bytes], batches: list[list[str]], budget_mb: int, prefetch_next: bool = False):
    """Each batch of URIs through one handler with ``pixel_budget_mb=budget_mb``; with
    ``prefetch_next`` the next batch is prefetched before each batch is handled (as the runner
    does while a batch is on the engine). Returns the results per batch, the engine and the
    budget's use at the end."""
    engine = BudgetWatchingEngine()
    handler = InferHandler(InferSettings(pixel_budget_mb=budget_mb), MemoryStore(objs), engine,
                           Telemetry("infer", TelemetrySettings()))
    engine.handler = handler
    recs = [[record(10 * b + i, u) for i, u in enumerate(uris)] for b, uris in enumerate(batches)]

    async def main():
        outs = []
        try:
            for b, batch in enumerate(recs):
                if prefetch_next and b + 1 < len(recs):
                    handler.prefetch(recs[b + 1])
                    await asyncio.sleep(0.5)  # the prefetch decodes what fits meanwhile
                outs.append(await asyncio.wait_for(handler.handle(batch), 60))
            return outs, handler.loader.budget.used
        finally:
            await handler.close()

    outs, used = asyncio.run(main())
    return [[ResultEvent.model_validate(orjson.loads(o.value)) for o in out] for out in outs], engine, used


def test_a_batch_over_the_pixel_budget_goes_through_the_engine_in_parts():
    # 600 x 600 RGB = 1,080,000 bytes a page; a 2 MiB budget holds one at a time... plus a part
    objs = {f"s3://b/{i}": png(600, 600 + i) for i in range(5)}
    [results], engine, used = budget_run(objs, [list(objs)], budget_mb=2)
    assert [r.status for r in results] == ["ok"] * 5
    assert [r.pages[0].height for r in results] == [600, 601, 602, 603, 604]
    assert max(engine.held) <= 2 << 20 and len(engine.calls) == 5
    assert used == 0  # every page's bytes given back


def test_an_image_larger_than_the_whole_budget_runs_alone():
    objs = {"s3://b/big": png(1500, 1000), "s3://b/small": png(300, 100)}  # 4.5 MB > 1 MiB
    [results], engine, used = budget_run(objs, [["s3://b/big", "s3://b/small"]], budget_mb=1)
    assert [r.status for r in results] == ["ok", "ok"]
    assert engine.held[0] == 4_500_032 and used == 0  # the big one alone (64-byte aligned)


def test_prefetched_pages_give_their_bytes_back_to_the_batch_in_flight():
    # the next batch's prefetch fills the budget before this batch is handled: this batch must
    # not wait on it (the prefetched pages are dropped and decoded again on their turn)
    objs = {f"s3://b/{i}": png(600, 600 + i) for i in range(6)}
    uris = list(objs)
    (first, second), engine, used = budget_run(objs, [uris[:3], uris[3:]], budget_mb=2, prefetch_next=True)
    assert [r.status for r in first + second] == ["ok"] * 6
    assert [r.pages[0].height for r in first + second] == [600, 601, 602, 603, 604, 605]
    assert max(engine.held) <= 2 << 20 and used == 0


def test_a_batch_that_fails_to_load_leaves_no_pixels_held():
    """One record of a prefetched batch fails to load (its image gone from S3: the runner retries
    it) while another's prefetch is still decoding: that decode ends after the batch failed, and
    its pages must be given back, not kept by an item nobody releases (the budget stayed
    taken for good, and a later image that did not fit the rest waited for ever)."""
    big = png(3000, 2000)  # 18,000,000 bytes of RGB: a prefetch that takes a moment to decode
    objs = {"s3://b/big": big, "s3://b/small": png(300, 100)}

    async def main():
        handler = InferHandler(InferSettings(pixel_budget_mb=32), MemoryStore(objs), ScriptedEngine(),
                               Telemetry("infer", TelemetrySettings()))
        try:
            batch = [record(1, "s3://b/gone"), record(2, "s3://b/big")]
            handler.prefetch(batch)
            await asyncio.sleep(0)
            with pytest.raises(OcrError) as err:
                await handler.handle(batch)
            assert err.value.code is ErrorCode.MISSING_OBJECT
            deadline = asyncio.get_running_loop().time() + 10
            pool = handler.loader.decoder
            while pool._slots.qsize() < pool.cfg.workers and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)  # until every decoder process is idle again (the prefetch ended)
            await asyncio.sleep(0.1)
            assert handler.loader.budget.used == 0
            # the runner's retry one record at a time: the big image alone goes through
            out = await asyncio.wait_for(handler.handle([record(2, "s3://b/big")]), 30)
            assert [ResultEvent.model_validate(orjson.loads(o.value)).status for o in out] == ["ok"]
            assert handler.loader.budget.used == 0
        finally:
            await handler.close()

    asyncio.run(main())
