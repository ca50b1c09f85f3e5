"""A 200-page PDF through the pipeline: split into pages with 1 and with 2 infer processes, and as one request.

Starts its own namespaced stages on the local stack (deploy/local/up.sh must have run), a fresh
namespace (topics, bucket, Redis prefix) per run, so nothing is answered from a cache. Each run
submits the same generated PDF (every page distinct: three printed lines) and waits for the
document's completion. Prints pages/s for each run, the speed-up of 2 infer processes over 1,
and the ratio of the split path to the one-request path (``OCRSTREAM_SPLIT_DOCUMENTS=false``,
with ``OCRSTREAM_LIMITS__MAX_PAGES`` raised to the page count: one infer process reads every
page under one 300 s limit, as before documents were split).

``--workers W`` sets each infer process's RapidOCR workers (``OCRSTREAM_RAPIDOCR_WORKERS``,
default 2: one process already keeps 2 cores busy, so on a 2-core machine only ``--workers 1``
shows what a second consumer adds).

Usage: python bench/document_bench.py [--pages 200] [--runs split1,split2,whole] [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from tests.stack import Pipeline, REPO, env_applied, namespace_env


def make_pdf(pages: int) -> bytes:
    """``pages`` distinct A6-ish pages (600 x 420 px at 200 dpi), three printed lines each."""
    try:
        font = ImageFont.truetype("DejaVuSans.ttf", 28)
    except OSError:
        font = ImageFont.load_default(28)
    imgs = []
    for n in range(1, pages + 1):
        img = Image.new("L", (600, 420), 255)
        d = ImageDraw.Draw(img)
        for i, text in enumerate((f"INVOICE {10000 + n}", f"PAGE {n} OF {pages}", f"TOTAL {n * 37 % 1000}.{n % 100:02d}")):
            d.text((40, 40 + i * 110), text, fill=0, font=font)
        imgs.append(img)
    buf = io.BytesIO()
    imgs[0].save(buf, "PDF", save_all=True, append_images=imgs[1:], resolution=200.0)
    return buf.getvalue()


def run_once(pdf: bytes, pages: int, infer_procs: int, split: bool, workers: int) -> tuple[float, str, int]:
    """Seconds from submit to the document's completion, its status and its line count."""
    env = {**namespace_env(partitions=4), "OCRSTREAM_SPLIT_DOCUMENTS": "true" if split else "false",
           "OCRSTREAM_LIMITS__MAX_PAGES": str(max(20, pages)), "OCRSTREAM_LIMITS__MAX_IMAGE_BYTES": str(200 << 20),
           "OCRSTREAM_DECODE__TIMEOUT_S": "600", "OCRSTREAM_LIMITS__INFER_TIMEOUT_S": "3600",
           "OCRSTREAM_RAPIDOCR_WORKERS": str(workers)}
    with env_applied(env):
        subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=REPO, check=True, capture_output=True)
        p = Pipeline(env=env, logdir=Path(tempfile.mkdtemp(prefix="docbench-")))
        for st in ("ingest", "dedup", "sink"):
            p.start(st, wait_ready=False)
        for _ in range(infer_procs):
            p.start("infer", wait_ready=False)
        try:
            for sts in p.stages.values():
                for st in sts:
                    p.wait_ready(st)
            t0 = time.perf_counter()
            [doc] = asyncio.run(p.run([(pdf, "bench.pdf")], timeout=3600, source="bench"))
            return time.perf_counter() - t0, doc.status, len(doc.lines) + doc.lines_omitted
        finally:
            p.stop_all()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=200)
    ap.add_argument("--runs", default="split1,split2,whole")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    pdf = make_pdf(args.pages)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; commit {commit}; "
          f"PDF: {args.pages} pages, {len(pdf)} bytes; {args.workers} RapidOCR worker(s) per infer process")
    rates: dict[str, float] = {}
    plan = {"split1": (1, True), "split2": (2, True), "whole": (1, False)}
    for name in args.runs.split(","):
        procs, split = plan[name]
        secs, status, lines = run_once(pdf, args.pages, procs, split, args.workers)
        rates[name] = args.pages / secs
        how = f"split, {procs} infer process{'es' if procs > 1 else ''}" if split else "one request (not split), 1 infer"
        print(f"{name}: {how}: {secs:.1f} s, {rates[name]:.2f} pages/s ({status}, {lines} lines)")
    if "split1" in rates and "split2" in rates:
        print(f"speed-up of 2 infer processes over 1: {rates['split2'] / rates['split1']:.2f}x")
    if "whole" in rates and "split1" in rates:
        print(f"split (1 infer) vs one request: {rates['split1'] / rates['whole']:.2f}x")
    if "whole" in rates and "split2" in rates:
        print(f"split (2 infers) vs one request: {rates['split2'] / rates['whole']:.2f}x")


if __name__ == "__main__":
    main()
