"""A backlog of 10,000 queued requests: every stage's memory stays bounded, nothing dropped, lag drains."""

from __future__ import annotations

import asyncio
import random

from tests.fault.conftest import reads_as, distinct_images


def rss_mib(pid: int) -> float:
    """Resident set size of a process, MiB (from /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def test_ten_thousand_queued_requests_drain_with_bounded_memory(fault_pipeline):
    p = fault_pipeline
    rng = random.Random(3)
    distinct = distinct_images(200, "BACKLOG")
    items = [distinct[i % len(distinct)] for i in range(10_000)]
    rng.shuffle(items)
    [infer] = [s for s in p.stages["infer"] if s.proc.poll() is None]
    p.stop(infer)  # the engine is away: everything queues up in Kafka and as waiters
    peaks: dict[str, float] = {}
    stop = asyncio.Event()

    async def sample():
        while not stop.is_set():
            for name, sts in p.stages.items():
                for st in sts:
                    if st.proc.poll() is None:
                        peaks[name] = max(peaks.get(name, 0.0), rss_mib(st.proc.pid))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    run = asyncio.create_task(p.run(items, timeout=1200))
    await asyncio.sleep(20)  # submitted and queued before the engine comes back
    p.start("infer")
    docs = await run
    stop.set()
    await sampler
    assert len(docs) == 10_000 and all(d.status == "ok" for d in docs)
    for (_, name), doc in zip(items, docs):
        assert reads_as(name, doc.text), (name, doc.text)
    print("peak RSS MiB:", {k: round(v) for k, v in peaks.items()})
    # bounds: the engine with its ONNX models, the others small and independent of the backlog
    # infer runs 2 images at once (OCRSTREAM_RAPIDOCR_WORKERS=2): RapidOCR alone peaks at about
    # 0.86 GiB with one image in flight and 1.35 GiB with two on these pages (measured in-process);
    # with the window (5 records), Python, the Kafka client and the allocator's spread the process
    # measured 1544 and 2005 MiB on two CI runs. PP-OCRv6 small (issue 34), measured in-process on 40 of
    # these images 2 at a time with 2 workers (layout and table models loaded too): peak 1219 MiB,
    # against 1264 MiB for PP-OCRv4 in the same probe. The bound is 2.5 GiB, under the 4608Mi limit of
    # deploy/values-cpu-small.yaml; a leak of 60 KB a request (600 MB over these 10,000) fails it.
    assert peaks["infer"] < 2560, peaks
    for name in ("ingest", "dedup", "sink"):
        assert peaks[name] < 400, peaks
