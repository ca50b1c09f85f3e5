"""End-to-end throughput and latency of the pipeline vs the raw engine, in one run.

Starts its own namespaced stages on the local stack (deploy/local/up.sh must have run),
pushes N sample images (a share of them byte-identical repeats) through ocr.submit and
waits for every completion. Prints: pipeline images/s end to end, the raw engine's images/s
on the same distinct images, their ratio, p50/p95 submit-to-completion latency, and engine
calls vs distinct images.

Usage: python bench/pipeline_bench.py [--n 48] [--dup-ratio 0.25] [--infer-procs 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from pathlib import Path

from bench.common import pct, raw_engine_rate, workload
from tests.stack import Pipeline, namespace_env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--dup-ratio", type=float, default=0.25)
    ap.add_argument("--infer-procs", type=int, default=1)
    ap.add_argument("--max-in-flight", type=int, default=0, help="infer's window (0: the engine's default)")
    args = ap.parse_args()

    items, unique = workload(args.n, args.dup_ratio)
    distinct = list({data: None for data, _ in items})
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; workload: {args.n} images, {unique} distinct")

    raw_rate, raw_secs = raw_engine_rate(distinct)
    print(f"raw engine: {len(distinct)} images in {raw_secs:.1f}s = {raw_rate:.2f} images/s")

    env = namespace_env(partitions=4)
    os.environ.update(env)
    import subprocess, sys

    subprocess.run([sys.executable, "-m", "services.cli", "init"], check=True, capture_output=True)
    p = Pipeline(env=env, logdir=Path(tempfile.mkdtemp(prefix="bench-")))
    for st in ("ingest", "dedup", "sink"):
        p.start(st, wait_ready=False)
    for _ in range(args.infer_procs):
        p.start("infer", {"OCRSTREAM_MAX_IN_FLIGHT": str(args.max_in_flight)} if args.max_in_flight else {}, wait_ready=False)
    for sts in p.stages.values():
        for st in sts:
            p.wait_ready(st)
    try:
        t0 = time.perf_counter()
        docs = asyncio.run(p.run(items, timeout=3600, source="bench"))
        wall = time.perf_counter() - t0
        calls = p.engine_calls()
    finally:
        p.stop_all()
    lat = [d.completed_at_ms - d.submitted_at_ms for d in docs]
    ok = sum(d.status == "ok" for d in docs)
    rate = len(docs) / wall
    unique_rate = unique / wall
    print(f"pipeline: {len(docs)} images ({ok} ok) in {wall:.1f}s = {rate:.2f} images/s end to end")
    print(f"distinct images/s through the pipeline: {unique_rate:.2f}; ratio to raw engine: {unique_rate / raw_rate:.2f}")
    print(f"latency submit->completion: p50 {pct(lat, 50):.0f} ms, p95 {pct(lat, 95):.0f} ms")
    print(f"engine calls {calls:.0f} vs distinct images {unique}")


if __name__ == "__main__":
    main()
