"""Kafka restarted, and Redis, S3, MariaDB stopped and started mid-run: stages wait, retry, carry on."""

from __future__ import annotations

import asyncio

import pytest

from tests.fault.conftest import reads_as, db_count, distinct_images, stack
from tests.stack import metric_value


@pytest.mark.parametrize("service", ["redis", "s3", "mariadb", "kafka"])
async def test_outage_mid_run_loses_nothing(fault_pipeline, service):
    p = fault_pipeline
    items = distinct_images(60, f"OUT {service.upper()}") + distinct_images(20, f"OUT {service.upper()}")  # 20 repeats
    run = asyncio.create_task(p.run(items, timeout=600))
    await asyncio.sleep(1.5)
    await asyncio.to_thread(stack, "down", service)
    await asyncio.sleep(4)
    await asyncio.to_thread(stack, "up", service)
    docs = await run
    for (_, name), doc in zip(items, docs):
        assert doc.status == "ok", (service, name, doc.error)
        assert reads_as(name, doc.text), (service, name, doc.text)
    counts = db_count([d.request_id for d in docs])
    assert len(counts) == len(docs) and set(counts.values()) == {1}
    if service == "redis":
        failures = metric_value(p.metrics("dedup"), "ocrstream_cache_total", outcome="error")
        assert failures > 0, "Redis failures must be counted"
    # every stage process survived the outage (no crash loop)
    for sts in p.stages.values():
        assert sum(st.proc.poll() is None for st in sts) == 1
