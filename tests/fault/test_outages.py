"""Kafka restarted, and Redis, S3, MariaDB stopped and started mid-run: stages wait, retry, carry on."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis

from services.common.settings import CommonSettings

from tests.fault.conftest import FAULT_ENV, reads_as, db_count, distinct_images, stack
from tests.stack import REPO, metric_value, namespaced_pipeline, require_stack

#: Each test stops or freezes a service every other test's stages use: scripts/test.sh runs them alone.
pytestmark = pytest.mark.exclusive


@pytest.fixture(scope="module")
def fault_pipeline(tmp_path_factory):
    """The fault tests' stages with the default Redis budget (100 ms), which a frozen Redis runs
    out (tests/stack.py raises it for every other test)."""
    require_stack()
    extra = {**FAULT_ENV, "OCRSTREAM_REDIS__TIMEOUT_MS": "100"}
    with namespaced_pipeline(tmp_path_factory.mktemp("outage-logs"), extra) as p:
        yield p


@pytest.mark.parametrize("service", ["redis", "s3", "mariadb", "kafka"])
async def test_outage_mid_run_loses_nothing(fault_pipeline, service):
    p = fault_pipeline
    items = distinct_images(60, f"OUT {service.upper()}") + distinct_images(20, f"OUT {service.upper()}")  # 20 repeats
    run = asyncio.create_task(p.run(items, timeout=600))
    expected = list(items)
    await asyncio.sleep(1.5)
    await asyncio.to_thread(stack, "down", service)
    try:
        if service == "redis":
            # more requests while Redis is down, and Redis stays down until dedup has looked some of
            # them up and failed (or skipped, breaker open): the no-Redis path itself is exercised
            def no_redis() -> float:
                m = p.metrics("dedup")
                return (metric_value(m, "ocrstream_cache_total", outcome="error", tier="redis")
                        + metric_value(m, "ocrstream_cache_total", outcome="skipped", tier="breaker"))

            before = no_redis()
            during = distinct_images(10, "OUT REDIS DOWN")
            expected += during
            run_during = asyncio.create_task(p.run(during, timeout=600))
            deadline = time.time() + 120
            while no_redis() == before:
                assert time.time() < deadline, "no request reached dedup while Redis was down"
                await asyncio.sleep(0.1)
            # and they complete while Redis is still down (the sink skips only the cache entry)
            during_docs = await run_during
            assert [d.status for d in during_docs] == ["ok"] * len(during), [d.error for d in during_docs]
        else:
            await asyncio.sleep(4)
    finally:  # back up whatever failed meanwhile: the tests after this one need it
        await asyncio.to_thread(stack, "up", service)
    docs = await run
    if service == "redis":
        docs += during_docs
    for (_, name), doc in zip(expected, docs, strict=True):
        assert doc.status == "ok", (service, name, doc.error)
        assert reads_as(name, doc.text), (service, name, doc.text)
    counts = db_count([d.request_id for d in docs])
    assert len(counts) == len(docs) and set(counts.values()) == {1}
    if service == "redis":
        failures = metric_value(p.metrics("dedup"), "ocrstream_cache_total", outcome="error")
        assert failures > 0, "Redis failures must be counted"
        # caching resumes without a restart: a new image gets its Redis entry again, and its repeat
        # is a hit (from dedup's settled window, before Redis is even asked). A stage's breaker stays
        # open up to redis.breaker_open_ms after its last failed call, so the first images after the
        # restart may be answered uncached: new ones are sent until one is cached, for up to a minute.
        r = redis.Redis.from_url(CommonSettings().redis.url)
        deadline = time.time() + 60
        for attempt in range(1000):
            data, name = distinct_images(1, f"OUT REDIS BACK{attempt}")[0]
            calls = p.engine_calls()
            [first] = await p.run([(data, name)], timeout=300)
            [again] = await p.run([(data, name)], timeout=300)
            assert first.status == again.status == "ok" and reads_as(name, again.text), (first.error, again.error)
            assert not first.cache_hit and again.cache_hit and again.text == first.text
            assert p.engine_calls() == calls + 1
            if r.exists(f"{CommonSettings().redis.key_prefix}:c:{first.cache_key}"):
                break
            assert time.time() < deadline, f"no image was cached in Redis in the minute after it came back ({attempt + 1} sent)"
            await asyncio.sleep(0.5)
    # every stage process survived the outage (no crash loop)
    for sts in p.stages.values():
        assert sum(st.proc.poll() is None for st in sts) == 1


async def test_a_frozen_redis_costs_no_request_and_opens_the_breaker(fault_pipeline):
    """Redis hung (SIGSTOP: connections accepted, nothing answered), not refused: every call would
    wait out its budget, so the breaker opens and calls fail at once. Requests submitted while it
    is frozen complete before it thaws, and caching resumes after, without a restart."""
    p = fault_pipeline
    pid = int((REPO / ".state" / "pids" / "redis.pid").read_text().split()[0])
    os.kill(pid, signal.SIGCONT)  # a run killed mid-test (no finally) may have left it frozen
    skipped = metric_value(p.metrics("dedup"), "ocrstream_cache_total", outcome="skipped", tier="breaker")
    items = distinct_images(12, "FROZEN REDIS")
    os.kill(pid, signal.SIGSTOP)
    try:
        docs = await p.run(items, timeout=300)
        for (_, name), doc in zip(items, docs, strict=True):
            assert doc.status == "ok" and reads_as(name, doc.text), (name, doc.error, doc.text)
        assert metric_value(p.metrics("dedup"), "ocrstream_cache_total", outcome="skipped", tier="breaker") > skipped
    finally:
        os.kill(pid, signal.SIGCONT)
    data, name = distinct_images(1, "FROZEN REDIS BACK")[0]
    deadline = time.time() + 60
    while True:  # the next trial call after the open period closes the breaker
        [first] = await p.run([(data, name)], timeout=300)
        [again] = await p.run([(data, name)], timeout=300)
        if again.cache_hit or time.time() > deadline:
            break
    assert first.status == again.status == "ok" and again.cache_hit and again.text == first.text
    for sts in p.stages.values():
        assert sum(st.proc.poll() is None for st in sts) == 1
