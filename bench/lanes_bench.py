"""An interactive image under bulk load: submit -> result of single images posted to the HTTP door
while a big job is queued, against the same kind of images when the pipeline is idle, one run.

Starts its own namespaced stages (ingest, dedup, infer, sink) and the HTTP door on the local stack
(deploy/local/up.sh must have run), in a fresh namespace. Then:

1. **Idle.** ``--probes`` single images (one-line printed text) posted to ``POST /v1/ocr`` one
   after the other, each followed by ``GET /v1/ocr/{id}?wait=`` until its result: latency from
   the POST to the answer. The cache is off in the namespace (``OCRSTREAM_CACHE_ENABLED=false``),
   so the same probe images are read again in 2 and each is compared with itself (on the
   stand-in a page's answer length, and so its time, depends on the image).
2. **Under load.** A job of ``--bulk`` distinct images (the same kind) published on ``ocr.submit``
   with a job id (the bulk lane), then, once dedup has passed ``--routed`` of them on to
   ``ocr.infer`` (98%: ingest has stored the job's images), the same probes as in 1, every
   ``--every`` seconds, each measured the same way. The
   bulk job is not waited for: the run ends when the last probe is answered (the namespace is
   left behind). Every probe checks that the job still had work queued when it was posted.

Prints p50 and p99 of both and their ratios (**target: under load <= 2x idle**), and the engine.

Engines (``--engine``):

- ``rapidocr``: the CPU engine with its default settings (``--det-limit`` sets its detector
  limit; the product's default is 736 px);
- ``standin``: the ``openai`` engine against the loopback stand-in for one GPU serving a VLM
  with continuous batching (:mod:`bench.vlm_standin`, started here), ``--concurrency`` requests
  in flight.

Usage: python -m bench.lanes_bench [--engine rapidocr|standin] [--bulk 2000] [--probes 20] [--every 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from bench.common import pct
from tests.conftest import text_image
from tests.stack import API, REPO, Pipeline, env_applied, free_port, namespace_env

PROBE_WAIT_S = 60


async def probe(client: httpx.AsyncClient, data: bytes) -> float:
    """One image through the door: seconds from the POST to its final answer.

    Raises:
        RuntimeError: the image did not end ``ok``.
    """
    t0 = time.perf_counter()
    r = await client.post("/v1/ocr", content=data, headers={"Content-Type": "image/png"})
    body = r.json()
    if r.status_code == 202:
        rid = body["request_id"]
        while body["status"] == "pending":
            body = (await client.get(f"/v1/ocr/{rid}", params={"wait": PROBE_WAIT_S})).json()
    took = time.perf_counter() - t0
    if body.get("status") != "ok":
        raise RuntimeError(f"probe ended {body.get('status')}: {body.get('error')}")
    return took


async def probes(url: str, tag: str, n: int, every_s: float, queued=None) -> list[float]:
    """``n`` probes, one every ``every_s`` seconds (each started then, answered whenever);
    ``queued()`` (when given) must say work is still queued when each is posted."""
    async with httpx.AsyncClient(base_url=url, timeout=PROBE_WAIT_S + 30) as client:
        tasks = []
        for i in range(n):
            if queued is not None and not await queued():
                raise RuntimeError(f"the bulk job drained before probe {i}: raise --bulk")
            data = text_image([f"PROBE {tag} {i:03d}"], size=28)
            tasks.append(asyncio.create_task(probe(client, data)))
            await asyncio.sleep(every_s)
        return list(await asyncio.gather(*tasks))


async def submit_bulk(n: int, tag: str) -> None:
    """A job of ``n`` distinct one-line images on ``ocr.submit`` (bulk: they carry its job id)."""
    from services.cli.client import Submitter
    from services.common.cache.keys import CacheKeySettings

    items = [(text_image([f"BULK {tag} {i:05d}"], size=28), f"bulk{i:05d}.png") for i in range(n)]
    sub = Submitter(CacheKeySettings())
    await sub.start()
    try:
        await sub.submit_many(items, source="bench", job_id=f"lanes-{tag}")
    finally:
        await sub.stop()


async def routed() -> int:
    """Records dedup has sent to ``ocr.infer`` (the bulk lane) so far: the sum of its end offsets."""
    from aiokafka import TopicPartition

    from services.common.kafka import make_consumer
    from services.common.cache.keys import CacheKeySettings

    s = CacheKeySettings()
    consumer = make_consumer(s.kafka, [], None, "lanes-bench-routed")
    await consumer.start()
    try:
        tps = [TopicPartition(s.topics.infer, p) for p in consumer.partitions_for_topic(s.topics.infer) or set()]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


async def infer_backlog() -> int:
    """Records on ``ocr.infer`` (the bulk lane) the infer group has not committed."""
    from tests.topics import lag

    from services.common.cache.keys import CacheKeySettings

    s = CacheKeySettings()
    return sum((await lag(os.environ["OCRSTREAM_INFER_GROUP_ID"], s.topics.infer, bound_s=0)).values())


def start_standin(concurrency: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.vlm_standin", "--port", str(port),
                             "--max-seqs", str(concurrency)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, f"{url}/v1"
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the stand-in did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("rapidocr", "standin"), default="rapidocr")
    ap.add_argument("--bulk", type=int, default=2000, help="images in the bulk job")
    ap.add_argument("--probes", type=int, default=20, help="interactive images per phase")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between probes")
    ap.add_argument("--det-limit", type=int, default=0, help="CPU engine: detector limit, px (0: the default)")
    ap.add_argument("--concurrency", type=int, default=256, help="stand-in: requests in flight (openai_max_concurrency)")
    ap.add_argument("--routed", type=float, default=0.98,
                    help="probe once this share of the job is on ocr.infer (ingest and dedup have passed it on; "
                         "before, a probe also shares the CPU with ingest storing the job's images)")
    args = ap.parse_args()

    from tests.stack import stack_reachable

    if missing := stack_reachable():
        sys.exit(f"local stack not reachable ({missing}): run deploy/local/up.sh")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; commit {commit}; engine {args.engine}; "
          f"bulk job {args.bulk}; {args.probes} probes every {args.every} s; load {os.getloadavg()[0]:.1f}", flush=True)
    standin = None
    engine_env: dict[str, str] = {}
    if args.engine == "standin":
        standin, url = start_standin(args.concurrency)
        engine_env = {"OCRSTREAM_ENGINE_KIND": "openai", "OCRSTREAM_ENGINE__ENGINE": "openai",
                      "OCRSTREAM_OPENAI_BASE_URL": url, "OCRSTREAM_OPENAI_MAX_CONCURRENCY": str(args.concurrency)}
    elif args.det_limit:
        engine_env = {"OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN": str(args.det_limit)}
    env = {**namespace_env(partitions=4), **engine_env, "OCRSTREAM_TELEMETRY__LOG_LEVEL": "WARNING",
           "OCRSTREAM_CACHE_ENABLED": "false"}
    logdir = Path(tempfile.mkdtemp(prefix="lanes-bench-"))
    tag = uuid.uuid4().hex[:6]
    p = Pipeline(env=env, logdir=logdir)
    try:
        with env_applied(env):
            subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=REPO, check=True, capture_output=True)
            p.start_all()
            door = p.start(API)
            url = f"http://127.0.0.1:{door.port}"
            asyncio.run(probes(url, f"{tag}w", 2, 0))  # warm-up: the door's and the stages' first calls
            idle = asyncio.run(probes(url, f"{tag}p", args.probes, args.every))
            print(f"idle: p50 {pct(idle, 50):.3f} s, p99 {pct(idle, 99):.3f} s; in order: "
                  + " ".join(f"{x:.2f}" for x in idle), flush=True)

            async def loaded() -> list[float]:
                await submit_bulk(args.bulk, tag)
                for _ in range(600):
                    if await routed() >= args.bulk * args.routed:
                        break
                    await asyncio.sleep(0.5)
                else:
                    raise RuntimeError("dedup did not pass the job on to ocr.infer within 300 s")
                backlog = await infer_backlog()
                print(f"bulk job submitted and passed on to ocr.infer; {backlog} of its records not done there",
                      flush=True)

                async def queued() -> bool:
                    return await infer_backlog() > 0

                return await probes(url, f"{tag}p", args.probes, args.every, queued)

            load = asyncio.run(loaded())
            left = asyncio.run(infer_backlog())
    finally:
        p.stop_all()
        if standin is not None:
            standin.kill()
    print(f"under load: p50 {pct(load, 50):.3f} s, p99 {pct(load, 99):.3f} s ({left} bulk records still queued "
          f"at the end); in order: " + " ".join(f"{x:.2f}" for x in load))
    each = sorted(b / a for a, b in zip(idle, load))
    print(f"RATIO p50 {pct(load, 50) / pct(idle, 50):.2f}x, p99 {pct(load, 99) / pct(idle, 99):.2f}x "
          f"(target <= 2x); per probe (the same image loaded / idle) median {pct(each, 50):.2f}x, "
          f"max {each[-1]:.2f}x; logs in {logdir}")


if __name__ == "__main__":
    main()
