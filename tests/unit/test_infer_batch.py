"""The infer handler's per-record logic with a small in-memory engine and store (no Kafka, no S3):
records handled concurrently (``handle`` runs every record's ``handle_record`` at once, as the
window runner keeps them in flight)."""

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
from services.common.codec import dumps
from services.common.records import RecordParser, Record
from services.common.settings import Limits, TelemetrySettings
from services.common.telemetry import Telemetry
from services.infer.textlines import Segment
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

    async def page(self, image, task, timeout_s, lane="bulk"):
        h, w = image.shape[:2]
        self.calls.append((h, w))
        await asyncio.sleep(0)
        if h == 111:
            raise EngineTimeout("too slow")
        if h == 222:
            raise RuntimeError("kaboom")
        warnings = ("truncated_max_tokens",) if h == 333 else ()
        return EngineOutput([Segment([[0, 0], [w, 0], [w, h], [0, h]], f"TEXT {h}x{w}", 0.9)], 5.0, warnings)


def png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), "white").save(buf, "PNG")
    return buf.getvalue()


DECODE = RecordParser({"ocr.infer": InferEvent})  # as InferHandler.consumes


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

    async def page(self, image, task, timeout_s, lane="bulk"):
        async with self._lock:
            began = asyncio.get_running_loop().time()
            self.started.append(image.shape[:2])
            await asyncio.sleep(self.seconds)
            return EngineOutput([], (asyncio.get_running_loop().time() - began) * 1000)


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
    # page 3 never started: the request's deadline passed during page 2, which was cancelled; the
    # one-page image's turn on the engine (before or between them) did not count against the TIFF
    assert {(100, 300), (101, 300), (50, 300)} <= set(engine.started) and (102, 300) not in engine.started


class DownWhenNotAloneEngine(ScriptedEngine):
    """Goes away (``took_down``) when a page arrives while another is on it; reads one page at a time."""

    def __init__(self):
        super().__init__()
        self.on = 0

    async def health(self) -> bool:
        return True

    async def page(self, image, task, timeout_s, lane="bulk"):
        self.on += 1
        try:
            await asyncio.sleep(0.01)
            if self.on > 1:
                raise EngineUnavailable("connection dropped", took_down=True)
            return await super().page(image, task, timeout_s, lane)
        finally:
            self.on -= 1


def test_copies_of_one_suspect_image_in_flight_together_are_each_settled():
    """Two copies of a suspect (same content hash; cache off or Redis down) in flight at once: each
    is read alone (nothing else on the engine), the first copy's read clears or convicts the
    image, and the second copy follows it."""
    sha = "a" * 64

    def copies() -> list[Record]:
        evs = [InferEvent(request=RequestEvent(request_id=f"c{i}", content_sha256=sha, image_uri="s3://b/x"),
                          cache_key=f"abcdefabcdef:{sha}") for i in range(2)]
        return [DECODE(ConsumerRecord("ocr.infer", 0, i, 0, 0, None, dumps(ev), None, 0, 0, [])) for i, ev in enumerate(evs)]

    # read through: the first copy's lone read clears it, the second is read too (alone or not)
    engine = DownWhenNotAloneEngine()
    handler = InferHandler(InferSettings(), MemoryStore({"s3://b/x": png(300, 100)}), engine,
                           Telemetry("infer", TelemetrySettings()))
    handler._crashes[sha] = 1  # one lone crash so far
    out = asyncio.run(handle_and_close(handler, copies()))
    results = [ResultEvent.model_validate(orjson.loads(o.value)) for o in out]
    assert [r.status for r in results] == ["ok", "ok"]
    assert [r.lines[0].text for r in results] == ["TEXT 100x300"] * 2
    assert sha not in handler._crashes and sha not in handler._convicted

    # at the limit: the first copy is convicted, the second shares its engine_crash without a read
    engine = DownWhenNotAloneEngine()
    handler = InferHandler(InferSettings(), MemoryStore({"s3://b/x": png(300, 100)}), engine,
                           Telemetry("infer", TelemetrySettings()))
    handler._crashes[sha] = InferSettings().engine_crash_limit
    out = asyncio.run(handle_and_close(handler, copies()))
    results = [ResultEvent.model_validate(orjson.loads(o.value)) for o in out]
    assert [r.error.code for r in results] == [ErrorCode.ENGINE_CRASH] * 2
    assert engine.calls == [] and sha in handler._convicted


def test_a_suspect_is_read_with_nothing_else_on_the_engine():
    """A suspect and three other images in flight together: the engine goes away whenever two
    pages are on it, yet every image ends ok, because the suspect waits for the others to leave
    the engine and the others wait while it is read."""
    engine = DownWhenNotAloneEngine()
    objs = {f"s3://b/{i}": png(300, 100 + i) for i in range(4)}
    handler = InferHandler(InferSettings(), MemoryStore(objs), engine, Telemetry("infer", TelemetrySettings()))
    handler._crashes[f"{0:064d}"] = 1  # record 0's image is a suspect

    class OneAtATime(DownWhenNotAloneEngine):
        pass

    async def main():
        try:
            # the three others read one at a time here (the engine takes one page); the suspect alone
            lock = asyncio.Lock()
            plain = engine.page

            async def serial(image, task, timeout_s, lane="bulk"):
                if image.shape[0] == 100:  # the suspect: never serialised, so only the gate keeps it alone
                    return await plain(image, task, timeout_s, lane)
                async with lock:
                    return await plain(image, task, timeout_s, lane)

            engine.page = serial
            return await handler.handle([record(i, f"s3://b/{i}") for i in range(4)])
        finally:
            await handler.close()

    results = [ResultEvent.model_validate(orjson.loads(o.value)) for o in asyncio.run(main())]
    assert [r.status for r in results] == ["ok"] * 4
    assert f"{0:064d}" not in handler._crashes


class BudgetWatchingEngine(ScriptedEngine):
    """Records, at every call, the bytes of decoded pixels its handler holds."""

    def __init__(self):
        super().__init__()
        self.handler: InferHandler | None = None
        self.held: list[int] = []

    async def page(self, image, task, timeout_s, lane="bulk"):
        self.held.append(self.handler.loader.budget.used)
        await asyncio.sleep(0.01)  # pages on the engine together hold their bytes together
        return await super().page(image, task, timeout_s, lane)


def budget_run(objs: dict[str, bytes], uris: list[str], budget_mb: int):
    """Every URI's record in flight at once through one handler with ``pixel_budget_mb=budget_mb``.
    Returns the results, the engine and the budget's use at the end."""
    engine = BudgetWatchingEngine()
    handler = InferHandler(InferSettings(pixel_budget_mb=budget_mb), MemoryStore(objs), engine,
                           Telemetry("infer", TelemetrySettings()))
    engine.handler = handler

    async def main():
        try:
            out = await asyncio.wait_for(handler.handle([record(i, u) for i, u in enumerate(uris)]), 60)
            return out, handler.loader.budget.used
        finally:
            await handler.close()

    out, used = asyncio.run(main())
    return [ResultEvent.model_validate(orjson.loads(o.value)) for o in out], engine, used


def test_records_over_the_pixel_budget_wait_for_room():
    # 600 x 600 RGB = 1,080,000 bytes a page; a 2 MiB budget holds one at a time
    objs = {f"s3://b/{i}": png(600, 600 + i) for i in range(5)}
    results, engine, used = budget_run(objs, list(objs), budget_mb=2)
    assert [r.status for r in results] == ["ok"] * 5
    assert [r.pages[0].height for r in results] == [600, 601, 602, 603, 604]
    assert max(engine.held) <= 2 << 20 and len(engine.calls) == 5
    assert used == 0  # every page's bytes given back


def test_an_image_larger_than_the_whole_budget_runs_alone():
    objs = {"s3://b/big": png(1500, 1000), "s3://b/small": png(300, 100)}  # 4.5 MB > 1 MiB
    results, engine, used = budget_run(objs, ["s3://b/big", "s3://b/small"], budget_mb=1)
    assert [r.status for r in results] == ["ok", "ok"]
    [big] = [held for (h, w), held in zip(engine.calls, engine.held) if w == 1000]  # downscaled for the engine
    assert big == 4_500_032 and used == 0  # the big one alone (64-byte aligned)


def test_a_record_that_fails_to_load_leaves_no_pixels_held():
    """One record fails to load (its image gone from S3: the runner retries it) while another,
    in flight beside it, decodes: the failure is raised only once the other has ended, and no
    pixels stay taken (a budget taken for good made a later image that did not fit wait for ever)."""
    objs = {"s3://b/big": png(3000, 2000), "s3://b/small": png(300, 100)}

    async def main():
        handler = InferHandler(InferSettings(pixel_budget_mb=32), MemoryStore(objs), ScriptedEngine(),
                               Telemetry("infer", TelemetrySettings()))
        try:
            with pytest.raises(OcrError) as err:
                await handler.handle([record(1, "s3://b/gone"), record(2, "s3://b/big")])
            assert err.value.code is ErrorCode.MISSING_OBJECT
            assert handler.loader.budget.used == 0
            out = await asyncio.wait_for(handler.handle([record(2, "s3://b/big")]), 30)
            assert [ResultEvent.model_validate(orjson.loads(o.value)).status for o in out] == ["ok"]
            assert handler.loader.budget.used == 0
        finally:
            await handler.close()

    asyncio.run(main())


def test_an_interactive_record_waits_for_pixels_only_behind_interactive_ones():
    """The budget is full and two bulk records wait for room; an interactive record arriving after
    them is decoded first when room frees."""
    objs = {f"s3://b/{i}": png(600, 600 + i) for i in range(4)}
    order: list[int] = []
    release = asyncio.Event()

    class Recording(ScriptedEngine):
        async def page(self, image, task, timeout_s, lane="bulk"):
            order.append(image.shape[0] - 600)
            if image.shape[0] == 600:
                await release.wait()  # record 0 holds the budget until every other record waits for room
            return await super().page(image, task, timeout_s, lane)

    def rec(i: int, topic: str) -> Record:
        ev = InferEvent(request=RequestEvent(request_id=f"r{i}", content_sha256=f"{i:064d}", image_uri=f"s3://b/{i}"),
                        cache_key=f"abcdefabcdef:{i:064d}")
        return RecordParser({topic: InferEvent})(ConsumerRecord(topic, 0, i, 0, 0, None, dumps(ev), None, 0, 0, []))

    async def main():
        handler = InferHandler(InferSettings(pixel_budget_mb=1), MemoryStore(objs), Recording(),
                               Telemetry("infer", TelemetrySettings()))
        try:
            budget = handler.loader.budget

            async def until(cond):  # decoder processes start first: slow on a loaded machine
                for _ in range(12_000):
                    if cond():
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError("timed out")

            topics = handler.s.topics  # the lane is read from the topic's name, as the settings give it
            first = asyncio.ensure_future(handler.handle_record(rec(0, topics.infer)))  # holds the whole budget
            await until(lambda: budget.used > 0)
            bulk = [asyncio.ensure_future(handler.handle_record(rec(i, topics.infer))) for i in (1, 2)]
            await until(lambda: budget.waiting == 2)
            urgent = asyncio.ensure_future(handler.handle_record(rec(3, topics.infer_interactive)))
            await until(lambda: budget.waiting == 3)
            release.set()
            await asyncio.wait_for(asyncio.gather(first, urgent, *bulk), 120)
        finally:
            await handler.close()

    asyncio.run(main())
    assert order[:2] == [0, 3] and sorted(order[2:]) == [1, 2]
