"""The decoder processes: same pages as in-process decoding, hard time and memory bounds, a pool
that survives its workers being killed, and the pixel budget. Real processes, no stack."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from PIL import Image

from schemas.errors import ErrorCode
from services.common.images.decoding import DecoderPool
from services.common.images.pixel_budget import PixelBudget
from services.common.errors import OcrError
from services.common.images.imaging import decode
from services.common.settings import DecodeSettings, Limits
from tests.attacks import chained_header_tiff, eps_file, nested_xobject_pdf
from tests.conftest import text_image
from tests.stack import REPO

LIMITS = Limits()


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def samples() -> dict[str, bytes]:
    frames = [Image.new("RGB", (120, 80), c) for c in ("white", "black", "gray")]
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: decoded upright, sides swapped
    marker = Image.new("RGB", (200, 100), "white")
    marker.paste((0, 0, 0), (0, 0, 40, 20))
    return {
        "png": text_image(["HELLO 42"]),
        "tiff3": encode(frames[0], "TIFF", save_all=True, append_images=frames[1:]),
        "pdf": encode(marker, "PDF", resolution=72),
        "jpeg exif 6": encode(marker, "JPEG", exif=exif, quality=95),
        "rgba": encode(Image.new("RGBA", (50, 30), (0, 0, 0, 0)), "PNG"),
    }


async def started(pool: DecoderPool) -> None:
    """Start every worker of ``pool`` (a worker starts on its first call): a timed call then measures
    its own work, not a Python start on a loaded machine."""
    png = samples()["png"]
    await asyncio.gather(*(pool.sniff(png) for _ in range(pool.cfg.workers)))


@pytest.fixture
async def pool():
    p = DecoderPool(DecodeSettings(workers=2, page_timeout_s=2, timeout_s=6, memory_mb=4096), LIMITS)
    await p.start()
    yield p
    await p.close()


async def test_pages_from_the_worker_equal_in_process_decoding(pool):
    for name, data in samples().items():
        plan = await pool.plan(data)
        got = await pool.decode(data, plan)
        want = decode(data, LIMITS.max_pixels, LIMITS.max_pages)
        assert [p.shape for p in got.pages] == [p.shape for p in want], name
        assert all(np.array_equal(a, b) for a, b in zip(got.pages, want)), name
        assert got.sizes == tuple((p.shape[1], p.shape[0]) for p in want), name
        assert [sorted(s) for s in plan.sizes] == [sorted(s) for s in got.sizes], name  # EXIF may turn page 1
        assert plan.nbytes >= sum(p.nbytes for p in want)
        got.release()
        assert got.pages == []
    assert (await pool.sniff(samples()["tiff3"])).frames == 3


async def test_each_page_says_what_its_transparency_was_flattened_onto(pool):
    light = Image.new("RGBA", (60, 40), (0, 0, 0, 0))
    light.paste((255, 255, 255, 255), (5, 5, 25, 15))
    dark = Image.new("RGBA", (60, 40), (0, 0, 0, 0))
    dark.paste((0, 0, 0, 255), (5, 5, 25, 15))
    opaque = Image.new("RGBA", (60, 40), (200, 200, 200, 255))
    tiff = encode(light, "TIFF", save_all=True, append_images=[dark, opaque])
    got = await pool.decode_all(tiff)
    assert got.backgrounds == ("black", "white", None)
    assert got.pages[0][5:15, 5:25].min() == 255 and got.pages[0][20:, 30:].max() == 0
    got.release()
    assert got.backgrounds == ("black", "white", None)  # kept for the result after the pixels go
    assert (await pool.decode_all(samples()["png"])).backgrounds == (None,)


async def test_a_spooled_file_is_read_by_the_worker_through_its_descriptor(pool):
    data = samples()["tiff3"]
    with tempfile.TemporaryFile() as spool:
        spool.write(data)
        spool.seek(5)  # the worker reads from the start whatever the caller's offset
        info = await pool.sniff(spool)
        assert (info.format, info.frames) == ("TIFF", 3)
        assert spool.tell() == 5  # the caller's file position is its own


async def test_a_pdf_page_of_unbounded_work_ends_decode_timeout_and_the_pool_goes_on(pool):
    pdf = nested_xobject_pdf(depth=7)  # 10^7 draws from 2 KB: a minute of rendering, gigabytes
    assert len(pdf) < 3000
    plan = await pool.plan(pdf)  # the page tree is fine: the format check passes
    assert plan.sizes == ((1700, 2200),)
    await started(pool)
    t0 = time.monotonic()
    with pytest.raises(OcrError) as err:
        await pool.decode(pdf, plan)
    took = time.monotonic() - t0
    assert err.value.code is ErrorCode.DECODE_TIMEOUT
    assert err.value.message == "decoding one page took longer than 2 s; the decoder was stopped"
    assert 1.9 < took < 8
    assert pool.restarts["timeout"] == 1
    ok = await pool.decode_all(samples()["png"])  # a new worker takes the killed one's place
    assert ok.pages[0].shape[2] == 3


async def test_a_page_that_needs_more_memory_than_the_cap_ends_image_too_complex():
    pool = DecoderPool(DecodeSettings(workers=1, memory_mb=400, page_timeout_s=60, timeout_s=60), LIMITS)
    try:
        big = encode(Image.new("L", (8000, 8000), 255), "PNG")  # 64 Mpx: ~190 MB RGB, more to convert
        t0 = time.monotonic()
        with pytest.raises(OcrError) as err:
            await pool.decode_all(big)
        assert err.value.code is ErrorCode.IMAGE_TOO_COMPLEX
        assert "400 MiB" in err.value.message
        with pytest.raises(OcrError) as err:
            await pool.decode_all(nested_xobject_pdf(depth=8))  # pdfium runs out of its cap
        assert err.value.code is ErrorCode.IMAGE_TOO_COMPLEX
        assert time.monotonic() - t0 < 60
        assert (await pool.decode_all(samples()["png"])).pages[0].shape[2] == 3
    finally:
        await pool.close()


async def test_format_checks_are_linear_and_only_documented_formats_open(pool):
    tiff = chained_header_tiff(100_000)  # Pillow's n_frames: about 94 s
    await started(pool)
    t0 = time.monotonic()
    with pytest.raises(OcrError) as err:
        await pool.sniff(tiff)
    assert err.value.code is ErrorCode.TOO_MANY_PAGES
    assert err.value.message == "image has more than 20 frames, limit 20"
    assert time.monotonic() - t0 < 3
    with pytest.raises(OcrError) as err:
        await pool.sniff(eps_file())
    assert err.value.code is ErrorCode.UNSUPPORTED_FORMAT
    for fmt in ("TGA", "PCX", "ICO"):  # readable by Pillow, not by ocrstream
        with pytest.raises(OcrError) as err:
            await pool.sniff(encode(Image.new("RGB", (32, 32), "white"), fmt))
        assert err.value.code is ErrorCode.UNSUPPORTED_FORMAT, fmt


async def test_a_worker_killed_from_outside_is_replaced(pool):
    [w, *_] = list(pool._all)
    w.proc.kill()
    w.proc.wait()
    for _ in range(4):  # whichever worker each call gets, every call answers
        assert (await pool.sniff(samples()["png"])).format == "PNG"


async def test_close_leaves_no_worker_and_a_killed_parent_takes_its_workers_along(pool):
    pids = [w.proc.pid for w in pool._all]
    await pool.close()
    assert all(not _alive(pid) for pid in pids)
    code = ("import asyncio, io, sys\nfrom PIL import Image\nfrom services.common.images.decoding import DecoderPool\n"
            "from services.common.settings import DecodeSettings, Limits\n"
            "async def main():\n    p = DecoderPool(DecodeSettings(workers=2), Limits())\n    await p.start()\n"
            "    png = io.BytesIO()\n    Image.new('RGB', (8, 8)).save(png, 'PNG')\n"
            "    await asyncio.gather(*(p.sniff(png.getvalue()) for _ in range(2)))\n"  # both ready: PR_SET_PDEATHSIG set
            "    print(' '.join(str(w.proc.pid) for w in p._all), flush=True)\n    await asyncio.sleep(60)\n"
            "asyncio.run(main())\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    children = [int(x) for x in parent.stdout.readline().split()]
    assert len(children) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


async def test_the_pixel_budget_is_first_come_first_served_and_lets_a_huge_image_run_alone():
    b = PixelBudget(100)
    assert b.try_acquire(60) and not b.try_acquire(50)
    order: list[str] = []

    async def take(name: str, n: int):
        await b.acquire(n)
        order.append(name)

    first = asyncio.ensure_future(take("a", 50))
    second = asyncio.ensure_future(take("b", 10))  # would fit, but waits its turn behind a
    await asyncio.sleep(0.01)
    assert order == [] and b.waiting == 2 and not b.try_acquire(1)
    b.release(60)
    await asyncio.gather(first, second)
    assert order == ["a", "b"] and b.used == 60
    huge = asyncio.ensure_future(take("huge", 1000))
    await asyncio.sleep(0.01)
    assert not huge.done()
    b.release(60)  # nothing held: the image larger than the budget runs alone
    await huge
    assert b.used == 1000
    b.release(1000)
    assert b.used == 0


async def test_a_cancelled_decode_stops_its_worker_at_once(pool):
    """A stage draining at SIGTERM cancels its batch: the render is killed, not waited for."""
    pdf = nested_xobject_pdf(depth=7)
    await started(pool)  # a slow start is not a render
    plan = await pool.plan(pdf)
    task = asyncio.ensure_future(pool.decode(pdf, plan))
    deadline = time.monotonic() + 10
    while pool._slots.qsize() == 2 and time.monotonic() < deadline:  # taken, and the request sent with it
        await asyncio.sleep(0.01)
    assert pool._slots.qsize() == 1 and not task.done()
    await asyncio.sleep(0.2)  # rendering: minutes of work that page_timeout_s (2 s) would stop
    busy = [w.proc for w in pool._all]
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):  # not decode_timeout: the cancel did not wait for the limit
        await task
    assert time.monotonic() - t0 < 1.5
    assert pool.restarts["cancelled"] == 1
    deadline = time.monotonic() + 2
    while not any(p.poll() is not None for p in busy) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert [p.poll() is not None for p in busy].count(True) == 1  # the rendering one ended, the idle one not
    assert (await pool.sniff(samples()["png"])).format == "PNG"


async def test_a_tiff_stored_sideways_decodes_upright(pool):
    """Pillow's TIFF plugin gives the upright size of a page with orientation 5-8 and turns its
    pixels as it loads them: the decoded sizes say what came out (the plan turned page 1 once
    more, and the request ended corrupt_image)."""
    stored = Image.new("RGB", (300, 100), "white")
    stored.paste((0, 0, 0), (0, 0, 30, 30))  # the stored top-left corner
    for orientation in (5, 6, 7, 8):
        exif = Image.Exif()
        exif[0x0112] = orientation
        tiff = encode(stored, "TIFF", exif=exif, save_all=True, append_images=[stored])
        jpeg = encode(stored, "JPEG", exif=exif.tobytes(), quality=100)
        plan = await pool.plan(tiff)
        assert plan.sizes == ((100, 300), (100, 300)), orientation  # Pillow writes the tag on both pages
        got = await pool.decode(tiff, plan)
        like_jpeg = (await pool.decode_all(jpeg)).pages[0]
        assert got.pages[0].shape == (300, 100, 3) == like_jpeg.shape
        assert got.sizes == ((100, 300), (100, 300))
        dark = got.pages[0].min(axis=2) < 128
        assert (dark == (like_jpeg.min(axis=2) < 128)).mean() > 0.99, orientation  # turned as the JPEG is
        assert int(dark.sum()) == 900
        got.release()


async def test_damaged_png_pixel_data_is_corrupt_image(pool):
    """Damaged or truncated PNG pixel data behind a sound header ends corrupt_image (an
    internal_error failed infer's whole batch and sent the record to the DLQ after three
    attempts), and the worker that found it goes on."""
    png = encode(Image.effect_noise((200, 200), 64).convert("RGB"), "PNG")
    assert (await pool.sniff(png[: len(png) // 2])).format == "PNG"  # the header alone is fine
    damaged = bytearray(png)
    damaged[len(png) // 2: len(png) // 2 + 16] = bytes(16)
    for data in (png[: len(png) // 2], bytes(damaged)):
        with pytest.raises(OcrError) as err:
            await pool.decode_all(data)
        assert err.value.code is ErrorCode.CORRUPT_IMAGE
        assert err.value.message.startswith("PNG image data could not be decoded: ")
    assert pool.restarts == {}  # the worker answered: nothing was killed
    assert (await pool.decode_all(png)).sizes == ((200, 200),)
