"""CPU engine tuning: images/s of RapidOCR for 1-2 processes x ONNX Runtime thread counts, in one run.

Each configuration runs P worker processes, each with its own RapidOCR session using T
intra-op threads, over the same distinct sample images (split between the processes).
Prints images/s per configuration and the ratio to the first; the best one is the default
(OCRSTREAM_RAPIDOCR_THREADS, infer processes per machine).

Usage: python -m bench.engine_tuning [--images 12] [--configs 1x1,1x2,2x1,2x2] [--model PP-OCRv6-small]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import time

from bench.common import sample_files
from services.common.cache.keys import RAPIDOCR_DEFAULT_MODEL
from services.infer.engines.base import OCR


def _worker(paths: list[str], threads: int, model: str, start, ready, out) -> None:
    import asyncio

    from services.common.images.imaging import decode
    from services.infer.engines.rapid import RapidOcrEngine

    async def run() -> None:
        engine = RapidOcrEngine(intra_op_threads=threads, model=model)
        await engine.start()
        pages = [decode(open(p, "rb").read(), 10**9, 10)[0] for p in paths]
        ready.put(os.getpid())
        start.wait()
        for page in pages:
            await engine.page(page, OCR, 600)
        out.put(time.perf_counter())

    asyncio.run(run())


def measure(paths: list[str], procs: int, threads: int, model: str = RAPIDOCR_DEFAULT_MODEL) -> float:
    """Images/s for ``procs`` processes with ``threads`` threads each over ``paths`` (``model``: engine.model)."""
    ctx = mp.get_context("spawn")
    start, ready, out = ctx.Event(), ctx.Queue(), ctx.Queue()
    shares = [paths[i::procs] for i in range(procs)]
    workers = [ctx.Process(target=_worker, args=(share, threads, model, start, ready, out)) for share in shares]
    for w in workers:
        w.start()
    for _ in workers:  # models loaded and images decoded (not timed)
        ready.get(timeout=600)
    t0 = time.perf_counter()
    start.set()
    ends = [out.get(timeout=1800) for _ in workers]
    for w in workers:
        w.join()
    return len(paths) / (max(ends) - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=12)
    ap.add_argument("--configs", default="1x1,1x2,2x1,2x2")
    ap.add_argument("--model", default=RAPIDOCR_DEFAULT_MODEL, help="engine.model (OCRSTREAM_ENGINE__MODEL)")
    args = ap.parse_args()
    files = sample_files()
    paths = [str(files[i % len(files)]) for i in range(args.images)]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {len(paths)} sample images per configuration; "
          f"{args.model}; load average {os.getloadavg()[0]:.1f}")
    base = None
    for cfg in args.configs.split(","):
        procs, threads = (int(x) for x in cfg.split("x"))
        rate = measure(paths, procs, threads, args.model)
        base = base or rate
        print(f"{procs} process(es) x {threads} thread(s): {rate:.3f} images/s  (x{rate / base:.2f} vs first)")


if __name__ == "__main__":
    main()
