"""What decoding in a decoder process costs against decoding in the stage's own process, in ONE run.

For each kind of input (a small printed-text PNG as the infer bench uses, an A4 page at 200 dpi as
PNG and JPEG, a 4-page TIFF, a one-page PDF), the same bytes are decoded ``--n`` times, alternating:

* ``in-process``: :func:`services.common.images.imaging.decode` (what infer did before: a thread of the
  stage, unbounded);
* ``worker``: :meth:`DecoderPool.plan` + :meth:`DecoderPool.decode` (format check and page sizes,
  then the pixels written by the decoder into a memfd the stage maps: no pickling, no copy
  through a pipe) and the pages touched once (their mean), so the mapping's page faults count.

Printed: ms per image of each, their ratio, and the extra ms per image. One worker, so both
sides use one core.

Usage: python -m bench.decode_bench [--n 20]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import time

from PIL import Image

from services.common.images.decoding import DecoderPool
from services.common.images.imaging import decode
from services.common.settings import DecodeSettings, Limits
from tests.conftest import text_image


def inputs() -> dict[str, bytes]:
    """The inputs, generated: name -> bytes."""
    a4 = Image.open(io.BytesIO(text_image([f"LINE {i:03d} OF A PRINTED PAGE" for i in range(40)], size=48,
                                          width=1654))).convert("RGB").resize((1654, 2339))
    out = {"text png 3 lines": text_image(["INVOICE 0042 TOTAL", "ITEM 7 QTY 3 PRICE 12.50", "THANK YOU"])}
    for fmt in ("PNG", "JPEG"):
        buf = io.BytesIO()
        a4.save(buf, fmt)
        out[f"A4 200 dpi {fmt}"] = buf.getvalue()
    buf = io.BytesIO()
    a4.save(buf, "TIFF", save_all=True, append_images=[a4] * 3, compression="tiff_deflate")
    out["A4 x 4 TIFF"] = buf.getvalue()
    buf = io.BytesIO()
    a4.save(buf, "PDF", resolution=200)
    out["A4 PDF page"] = buf.getvalue()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20)
    args = ap.parse_args()
    limits = Limits()
    pool = DecoderPool(DecodeSettings(workers=1), limits)
    await pool.start()
    try:
        print(f"{'input':20} {'bytes':>9} {'in-process ms':>14} {'worker ms':>10} {'ratio':>6} {'extra ms':>9}")
        for name, data in inputs().items():
            (await pool.decode_all(data)).release()  # warm
            inproc, worker = [], []
            for _ in range(args.n):
                t0 = time.perf_counter()
                pages = decode(data, limits.max_pixels, limits.max_pages)
                _ = [p.mean() for p in pages]
                inproc.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = await pool.decode_all(data)
                _ = [p.mean() for p in got.pages]
                got.release()
                worker.append(time.perf_counter() - t0)
            a, b = statistics.median(inproc) * 1000, statistics.median(worker) * 1000
            print(f"{name:20} {len(data):9d} {a:14.1f} {b:10.1f} {b / a:6.2f} {b - a:9.1f}")
    finally:
        await pool.close()


if __name__ == "__main__":
    asyncio.run(main())
