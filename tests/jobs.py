"""Helpers of the job tests (tests/integration/test_jobs.py, tests/fault/test_job_crashes.py):
a job's items with repeats and bad inputs, waiting for its final count, reading its completions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition

from schemas.errors import ErrorCode
from schemas.jobs import JobProgress
from services.common.jobs.store import JobStore
from services.common.kafka import make_consumer
from services.common.settings import CommonSettings
from tests.conftest import CASES, text_image

BAD = [  # (bytes, name, the code it ends with)
    (b"", "empty.jpg", ErrorCode.EMPTY_INPUT),
    ((CASES / "img17_truncated.jpg").read_bytes(), "truncated.jpg", ErrorCode.CORRUPT_IMAGE),
    (b"just some text, not an image\n" * 20, "notes.png", ErrorCode.UNSUPPORTED_FORMAT),
    (b"<html><body>not an image</body></html>\n" * 5, "page.jpg", ErrorCode.UNSUPPORTED_FORMAT),
    ((CASES / "img17_truncated.jpg").read_bytes()[:300], "cut.jpg", ErrorCode.CORRUPT_IMAGE),
]
#: The :data:`BAD` inputs' error codes and how many end with each.
BAD_CODES = {"corrupt_image": 2, "empty_input": 1, "unsupported_format": 2}


def job_items(tag: str, n: int) -> list[tuple[bytes, str]]:
    """``n`` ``(bytes, filename)`` items, in this order: ``n - round(0.3 n) - 5`` unique images
    (text ``JOB <tag> <i>``, ``img<i>.png``), ``round(0.3 n)`` repeats of the first of them
    (``again<i>.png``) and the 5 :data:`BAD` inputs."""
    repeats = round(n * 0.3)
    unique = n - repeats - len(BAD)
    uniq = [(text_image([f"JOB {tag} {i:03d}"], size=28), f"img{i:03d}.png") for i in range(unique)]
    rep = [(uniq[i % unique][0], f"again{i:03d}.png") for i in range(repeats)]
    return uniq + rep + [(b, name) for b, name, _ in BAD]


async def job_completions(job_id: str, settle_s: float = 3.0, timeout: float = 120) -> list[bytes]:
    """Every ``ocr.job-completed`` record of ``job_id`` (every partition, from the topic's start),
    waiting for the first and then ``settle_s`` seconds more for any repeat."""
    s = CommonSettings()
    consumer = make_consumer(s.kafka, [], None, client_id="test-jobs", auto_offset_reset="earliest")
    await consumer.start()
    found: list[bytes] = []
    try:
        parts = consumer.partitions_for_topic(s.topics.job_completed) or set()
        if not parts:
            await consumer._client.force_metadata_update()
            parts = consumer.partitions_for_topic(s.topics.job_completed) or set()
        tps = [TopicPartition(s.topics.job_completed, p) for p in sorted(parts)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        deadline, until = time.monotonic() + timeout, None
        while time.monotonic() < (until or deadline):
            batch = await consumer.getmany(timeout_ms=300)
            for recs in batch.values():
                found.extend(r.value for r in recs if r.key == job_id.encode())
            if found and until is None:
                until = time.monotonic() + settle_s
    finally:
        await consumer.stop()
    return found


async def wait_final(store: JobStore, job_id: str, want: int, seen: list[JobProgress], timeout: float = 300,
                     each: Callable[[JobProgress], Awaitable[None]] | None = None) -> JobProgress:
    """Poll the job's progress (what ``GET /v1/jobs/{id}`` answers) every 0.2 s until ``want``
    requests are final; every progress read goes to ``seen`` and, when given, to ``each``
    (awaited before the next read).

    Raises:
        AssertionError: Not ``want`` final requests within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        prog = await store.progress(job_id)
        if prog is not None:
            seen.append(prog)
            if each is not None:
                await each(prog)
            if prog.done >= want:
                return prog
        await asyncio.sleep(0.2)
    raise AssertionError(f"job {job_id}: {[p.done for p in seen[-1:]]} of {want} final after {timeout}s")
