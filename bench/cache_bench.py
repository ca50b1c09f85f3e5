"""Dedup and cache through the full Kafka path, with the cache on and off, in one run.

N requests (default 12,000) of which a share (default 43%) are byte-identical repeats of
earlier images, re-ordered (each repeat at a random later place than its first copy), paced at
--rate requests/s, as one mixed stream. Small printed-text images keep the engine's share
small, so what is measured is the pipeline. For each setting it prints:

- engine calls (the infer stages' ``ocrstream_engine_images_total``) vs unique cache keys (the
  distinct ``cache_key`` of the completions): with the cache on they must be equal, and the
  script exits 1 when they are not;
- submit -> completion latency p50/p99 of all repeats, and split into repeats that arrived
  after their first copy completed (served from the cache) and repeats that joined an
  in-flight inference, and of first copies. "Completion" is the moment this client receives the
  request's event from ``ocr.completed``: every hop, the MariaDB writes and the completion
  topic included;
- where the time of a repeat served from the cache goes: the p50 of each ``timings_ms`` entry
  of its completion (queue waits before ingest, dedup and sink, each stage's own work) and of
  the rest (the sink's batched MariaDB write and its ``ocr.completed`` publish, this client's
  fetch).

The images are generated, not ``../shared/samples``: 12 scanned documents cannot give 6,840
distinct images, and at ~1.5 s of engine time each a run would take hours on 2 cores.

The engine runs with its detector limit at ``--det-limit`` (default 96 px, the setting
``OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN``; the product default is 736): at 736 RapidOCR scales
each 90x421 px bench image up 8x and takes ~1.6 s on it, which makes the 18,840 engine calls of
the two settings ~3 h on 2 cores; at 96 they take ~70 ms each. Engine calls vs unique keys
and the latency of cache hits do not depend on it; the cache-off latency of repeats does (it
is lower with the faster engine, so the cache's advantage is understated, not overstated).

``--warm-first`` is a second, narrower measurement: every distinct image is completed first,
then only the repeats are paced, so each repeat finds its result stored.

Usage: python -m bench.cache_bench [--n 12000] [--dup-ratio 0.43] [--rate 10] [--warm-first] [--det-limit 96]
       [--skip-disabled] [--redis-down]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import pct
from services.cli.client import Submitter
from services.common.results.completions import CompletionWatcher
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.stack import Pipeline, free_port, namespace_env


def make_workload(n: int, dup_ratio: float, seed: int = 11) -> tuple[list[bytes], int]:
    """Request bodies: distinct printed images, then repeats of earlier ones spliced in at random later places."""
    rng = random.Random(seed)
    unique = round(n * (1 - dup_ratio))
    images = [text_image([f"BENCH {i:05d} {rng.randrange(10**6):06d}"], size=28) for i in range(unique)]
    seq = list(range(unique))
    for _ in range(n - unique):
        j = rng.randrange(unique)
        seq.insert(rng.randrange(seq.index(j) + 1, len(seq) + 1), j)  # a repeat comes after its first copy
    return [images[i] for i in seq], unique


async def drive(p: Pipeline, bodies: list[bytes], rate: float, timeout: float,
                warm_first: bool = False) -> list[tuple[bytes, float, float, str, dict]]:
    """Submit at ``rate``/s; returns (body, submitted_at, completed_at, cache_key, timings_ms)
    per request (``timings_ms``: the completion's per-stage milliseconds).

    Times are seconds since the epoch on this machine's clock: submitted just before the produce,
    completed when this client receives the request's ``ocr.completed`` event.

    With ``warm_first`` every distinct image is submitted (unpaced) and completed first, then the
    repeats are paced at ``rate``: each repeat then finds its result stored, which is what a
    repeat-latency figure should measure (a backlog measures the engine instead).
    """
    s = CommonSettings()
    watcher, submitter = CompletionWatcher(s), Submitter(s)
    await watcher.start()
    await submitter.start()
    sent: dict[str, tuple[bytes, float]] = {}
    done: dict[str, tuple[float, str, dict]] = {}

    async def collect():
        async for ev in watcher.completions_forever():
            done[ev.request_id] = (time.time(), ev.result.cache_key or "", dict(ev.result.timings_ms))
            if len(done) == len(bodies):
                return

    async def submit(part_bodies: list[bytes], pace: float) -> None:
        t0 = time.time()
        chunk = max(1, int(pace / 20))
        for i in range(0, len(part_bodies), chunk):
            part = part_bodies[i : i + chunk]
            now = time.time()
            ids = await submitter.submit_many([(b, None) for b in part], source="bench")
            for rid, body in zip(ids, part):
                sent[rid] = (body, now)
            lag = t0 + (i + len(part)) / pace - time.time()
            if lag > 0:
                await asyncio.sleep(lag)

    collector = asyncio.create_task(collect())
    if warm_first:
        seen: set[bytes] = set()
        firsts = [b for b in bodies if not (b in seen or seen.add(b))]
        rest = list(bodies)
        for b in firsts:
            rest.remove(b)
        await submit(firsts, 1e9)
        deadline = time.time() + timeout
        while len(done) < len(firsts) and time.time() < deadline:
            await asyncio.sleep(0.5)
        await submit(rest, rate)
    else:
        await submit(bodies, rate)
    await submitter.stop()
    await asyncio.wait_for(collector, timeout)
    await watcher.stop()
    return [(body, at, *done[rid]) for rid, (body, at) in sent.items()]


def breakdown(latencies_ms: list[float], timings: list[dict]) -> str:
    """Where the time of a set of requests goes: the median of each stage's ``timings_ms`` entry
    (queue waits, the stages' own work; the sink's ``write`` is its work before the batched
    MariaDB write, since the document is built before it is written) and of the rest per request:
    the sink's batched MariaDB write, its ``ocr.completed`` publish and this client's fetch."""
    if not timings:
        return ""
    keys = [k for k in timings[0] if k != "total" and all(k in t for t in timings)]
    rest = [lat - sum(t[k] for k in keys) for lat, t in zip(latencies_ms, timings)]
    parts = [f"{k} {pct([t[k] for t in timings], 50):.1f}" for k in keys] + [f"rest {pct(rest, 50):.1f}"]
    return "p50 ms by hop: " + ", ".join(parts)


def summarize(label: str, rows: list[tuple[bytes, float, float, str, dict]], calls: float, unique: int) -> int:
    """Print one setting's figures; returns the number of unique cache keys among the completions."""
    first_done: dict[bytes, float] = {}
    first_seen: set[bytes] = set()
    firsts, joined, hits, hit_timings = [], [], [], []
    keys = {row[3] for row in rows if row[3]}
    for body, sub, comp, _key, timings in sorted(rows, key=lambda r: r[1]):
        ms = (comp - sub) * 1000
        if body not in first_seen:
            first_seen.add(body)
            first_done[body] = comp
            firsts.append(ms)
        elif sub >= first_done[body]:
            hits.append(ms)
            hit_timings.append(timings)
        else:
            joined.append(ms)
    print(f"[{label}] requests {len(rows)}, distinct images {unique}, unique cache keys {len(keys)}, "
          f"engine calls {calls:.0f}")
    for name, vals in (("all repeats", hits + joined), ("  repeats after completion", hits),
                       ("  repeats joining in-flight", joined), ("first copies", firsts)):
        if vals:
            print(f"[{label}]   {name:28} n={len(vals):6d}  p50 {pct(vals, 50):10.1f} ms  p99 {pct(vals, 99):10.1f} ms")
    if hits:
        print(f"[{label}]   repeats after completion, {breakdown(hits, hit_timings)}")
    return len(keys)


def run_setting(label: str, bodies: list[bytes], unique: int, rate: float, extra: dict[str, str],
                warm_first: bool = False) -> tuple[float, int]:
    """One setting on a fresh namespace and pipeline; returns (engine calls, unique cache keys)."""
    env = namespace_env(partitions=4)
    os.environ.update(env)
    subprocess.run([sys.executable, "-m", "services.cli", "init"], check=True, capture_output=True)
    p = Pipeline(env={**env, **extra}, logdir=Path(tempfile.mkdtemp(prefix="cache-bench-")))
    p.start_all()
    try:
        t0 = time.perf_counter()
        rows = asyncio.run(drive(p, bodies, rate, timeout=7200, warm_first=warm_first))
        wall = time.perf_counter() - t0
        calls = p.engine_calls()
    finally:
        p.stop_all()
    print(f"[{label}] {len(rows)} requests in {wall:.1f}s = {len(rows) / wall:.1f} requests/s")
    return calls, summarize(label, rows, calls, unique)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=12000)
    ap.add_argument("--dup-ratio", type=float, default=0.43)
    ap.add_argument("--rate", type=float, default=10.0,
                    help="submitted requests per second (10: below the engine's ~14 images/s at 96 px, so no backlog)")
    ap.add_argument("--det-limit", type=int, default=96,
                    help="engine detector limit in px (OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN; product default 736)")
    ap.add_argument("--skip-disabled", action="store_true", help="no cache-off run")
    ap.add_argument("--redis-down", action="store_true",
                    help="also a cache-on run whose stages point at a Redis that is not there (dedup's keyed state, "
                         "its settled window and the S3 tier answer; exits 1 unless engine calls = unique keys)")
    ap.add_argument("--warm-first", action="store_true",
                    help="complete every distinct image first, then pace the repeats (repeat latency without a backlog)")
    args = ap.parse_args()
    bodies, unique = make_workload(args.n, args.dup_ratio)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {args.n} requests, {unique} distinct "
          f"({1 - unique / args.n:.0%} repeats), paced at {args.rate:.0f}/s, "
          f"{'distinct images completed first, ' if args.warm_first else ''}engine detector limit {args.det_limit} px")
    engine = {"OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN": str(args.det_limit)}  # part of the cache key
    calls, keys = run_setting("cache on", bodies, unique, args.rate, engine, args.warm_first)
    failed = round(calls) != keys
    if args.redis_down:
        down = {**engine, "OCRSTREAM_REDIS__URL": f"redis://127.0.0.1:{free_port()}/0"}  # nothing listens there
        down_calls, down_keys = run_setting("cache on, Redis down", bodies, unique, args.rate, down, args.warm_first)
        print(f"{'OK' if round(down_calls) == down_keys else 'FAILED'}: with Redis down, engine calls "
              f"{down_calls:.0f} {'==' if round(down_calls) == down_keys else '!='} unique cache keys {down_keys}")
        failed = failed or round(down_calls) != down_keys
    if not args.skip_disabled:
        run_setting("cache off", bodies, unique, args.rate, {**engine, "OCRSTREAM_CACHE_ENABLED": "false"}, args.warm_first)
    print(f"{'FAILED' if round(calls) != keys else 'OK'}: with the cache on, engine calls {calls:.0f} "
          f"{'!=' if round(calls) != keys else '=='} unique cache keys {keys}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
