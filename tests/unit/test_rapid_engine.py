"""The CPU engine's guards: thin strips, per-image timeouts that do not leak into the next image."""

import asyncio

import numpy as np
import pytest_asyncio

from tests.engines import read_all
from services.infer.engines.base import OCR
from services.infer.engines.base import EngineTimeout
from services.infer.engines.rapid import RapidOcrEngine
from tests.conftest import text_image


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine():
    """One started default engine (one worker) for the tests below: starting one takes ~3 s (its warm-up)."""
    eng = RapidOcrEngine()
    await eng.start()
    yield eng
    await eng.close()


async def test_thin_strips_are_handled_without_blowing_up_memory(engine):
    white = lambda h, w: np.full((h, w, 3), 255, np.uint8)  # noqa: E731
    out = await read_all(engine, [white(1, 100_000), white(30, 1999), white(1999, 30)], OCR, timeout_s=120)
    assert all(not isinstance(o, BaseException) and o.segments == [] for o in out), out


async def test_a_timed_out_image_does_not_eat_the_next_images_budget(engine):
    from io import BytesIO

    from PIL import Image

    page = np.asarray(Image.open(BytesIO(text_image(["TIMEOUT CHECK 42"]))).convert("RGB"))
    assert engine.workers == 1
    [first] = await read_all(engine, [page], OCR, timeout_s=0.001)
    assert isinstance(first, EngineTimeout)
    [second] = await read_all(engine, [page], OCR, timeout_s=60)
    assert not isinstance(second, BaseException), second
    assert " ".join(s.text for s in second.segments) == "TIMEOUT CHECK 42"


def test_detector_limit_setting_reaches_rapidocr():
    """OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN=96: a 90x400 px line goes to the detector at
    96x416 instead of 736x3264 (8x upscale), and is still found as one text line."""
    from io import BytesIO

    from PIL import Image

    from services.common.cache.keys import EngineIdentity
    from services.infer.main import build_engine
    from services.infer.settings import InferSettings

    page = np.asarray(Image.open(BytesIO(text_image(["LIMIT 96 OK"], size=28))).convert("RGB"))
    assert page.shape[:2] == (90, 400)

    async def run():
        engine = build_engine(InferSettings(engine=EngineIdentity(det_limit_side_len=96), rapidocr_workers=1))
        await engine.start()
        try:
            det = engine._read.ocr.text_det
            assert det.limit_side_len == 96
            assert det.get_preprocess().resize(page).shape[:2] == (96, 416)
            [out] = await read_all(engine, [page], OCR, timeout_s=60)
            assert not isinstance(out, BaseException), out
            assert len(out.segments) == 1
        finally:
            await engine.close()

    asyncio.run(run())


async def test_spaces_the_recogniser_drops_are_put_back_and_light_text_on_dark_too(engine):
    from io import BytesIO

    from PIL import Image, ImageOps

    from services.infer.textlines import group_lines

    lines = ["TICKET 5590", "ORDER NUMBER 3344"]
    page = np.asarray(Image.open(BytesIO(text_image(lines))).convert("RGB"))
    inverted = np.asarray(ImageOps.invert(Image.fromarray(page)))

    outs = await read_all(engine, [page, inverted], OCR, timeout_s=120)
    for out in outs:
        assert [line.text for line in group_lines(out.segments)] == lines


async def test_an_interactive_page_starts_at_once_beside_busy_workers_and_bulk_threads_yield_the_cpu():
    """One worker reading a bulk page that has not ended: an interactive page runs at once on an
    interactive slot (ONNX Runtime cannot be interrupted, so it would otherwise wait), and a
    second bulk page waits. Bulk pages run on threads at niceness +10 (Linux), interactive ones
    as the process does."""
    import os
    import sys
    import threading

    from services.infer.engines.base import EngineOutput

    engine = RapidOcrEngine(workers=1, interactive_workers=1, bulk_nice=10)
    release = threading.Event()
    seen: list[tuple[int, int]] = []  # (page height, niceness of the thread reading it)

    def one(image, task="ocr"):
        seen.append((image.shape[0], os.getpriority(os.PRIO_PROCESS, 0)))
        if image.shape[0] == 10:
            release.wait(30)
        return EngineOutput([], 1.0)

    engine._one = one
    page = lambda h: np.full((h, 40, 3), 255, np.uint8)  # noqa: E731
    try:
        slow = asyncio.ensure_future(engine.page(page(10), OCR, 60, "bulk"))
        await asyncio.sleep(0.1)
        waiting = asyncio.ensure_future(engine.page(page(30), OCR, 60, "bulk"))
        await asyncio.wait_for(engine.page(page(20), OCR, 60, "interactive"), 10)  # while the worker is held
        assert engine.busy == 1 and not waiting.done()
        release.set()
        await asyncio.wait_for(asyncio.gather(slow, waiting), 30)
    finally:
        release.set()
        await engine.close()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    bulk_nice = base + 10 if sys.platform == "linux" else base
    assert seen == [(10, bulk_nice), (20, base), (30, bulk_nice)]


async def test_interactive_pages_alone_use_the_workers_only():
    """With no bulk page on the workers, interactive pages take the workers (one here) and wait
    for them: the interactive thread is for getting past bulk pages, not more pages at once."""
    import threading

    from services.infer.engines.base import EngineOutput

    engine = RapidOcrEngine(workers=1, interactive_workers=1)
    release = threading.Event()
    running = []

    def one(image, task="ocr"):
        running.append(image.shape[0])
        release.wait(30)
        return EngineOutput([], 1.0)

    engine._one = one
    page = lambda h: np.full((h, 40, 3), 255, np.uint8)  # noqa: E731
    try:
        first = asyncio.ensure_future(engine.page(page(10), OCR, 60, "interactive"))
        second = asyncio.ensure_future(engine.page(page(20), OCR, 60, "interactive"))
        for _ in range(300):  # until the first is on the engine's thread (slow to start on a loaded machine)
            if running:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # time for the second to start too, if it could
        assert running == [10] and engine.busy == 1 and not second.done()
        release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 30)
    finally:
        release.set()
        await engine.close()
    assert running == [10, 20]
