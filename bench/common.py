"""Helpers shared by the benchmarks: distinct copies of the samples, percentiles, a raw engine run."""

from __future__ import annotations

import asyncio
import io
import random
import time
from pathlib import Path

import numpy as np
from PIL import Image, PngImagePlugin

from services.common.images.imaging import decode
from services.infer.engines.base import OCR

SAMPLES = Path(__file__).resolve().parent.parent.parent / "shared" / "samples"


def sample_files() -> list[Path]:
    """The sample documents (images only)."""
    return sorted(p for p in SAMPLES.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))


def distinct_variant(data: bytes, salt: int) -> bytes:
    """Same pixels, different bytes: the image re-encoded as PNG with a text chunk ``salt``.

    Gives a new SHA-256 (so a cache miss) with exactly the original's OCR workload.
    """
    img = Image.open(io.BytesIO(data))
    info = PngImagePlugin.PngInfo()
    info.add_text("ocrstream-bench", str(salt))
    buf = io.BytesIO()
    img.save(buf, "PNG", pnginfo=info)
    return buf.getvalue()


def workload(n: int, dup_ratio: float, seed: int = 7) -> tuple[list[tuple[bytes, str]], int]:
    """``n`` (bytes, name) items of which about ``dup_ratio`` are byte-identical repeats, shuffled.

    Returns:
        The items and the number of distinct images among them.
    """
    rng = random.Random(seed)
    files = sample_files()
    unique = max(1, round(n * (1 - dup_ratio)))
    base = [(distinct_variant(files[i % len(files)].read_bytes(), i), f"{files[i % len(files)].stem}-{i}.png")
            for i in range(unique)]
    items = list(base) + [base[rng.randrange(unique)] for _ in range(n - unique)]
    rng.shuffle(items)
    return items, unique


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation (numpy's default)."""
    return float(np.percentile(values, q)) if values else float("nan")


def raw_engine_rate(images: list[bytes], threads: int = 2, det_limit_side_len: int | None = None,
                    workers: int = 1) -> tuple[float, float]:
    """Images/s of RapidOCR called directly on ``images`` (decoded first, not timed), with the
    detector limit ``det_limit_side_len`` in px (None: the engine's default, RapidOCR's 736),
    ``threads`` ONNX Runtime threads per image and ``workers`` images at once: every image handed
    to :meth:`~services.infer.engines.rapid.RapidOcrEngine.page` at once, the workers a pool with
    no barrier (1 worker: one image at a time).

    Returns:
        ``(images per second, seconds)``.
    """
    from services.infer.engines.rapid import RapidOcrEngine

    async def run() -> float:
        limit = {} if det_limit_side_len is None else {"det_limit_side_len": det_limit_side_len}
        engine = RapidOcrEngine(intra_op_threads=threads, workers=workers, **limit)
        await engine.start()
        pages = [decode(b, 10**9, 100)[0] for b in images]
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.page(p, OCR, 600) for p in pages))
        secs = time.perf_counter() - t0
        await engine.close()
        return secs

    secs = asyncio.run(run())
    return len(images) / secs, secs
