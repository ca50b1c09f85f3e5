"""SIGKILL and SIGTERM of each stage mid-run: nothing lost, one final state per request."""

from __future__ import annotations

import asyncio
import signal
import time

from tests.fault.conftest import reads_as, db_count, distinct_images
from tests.stack import STAGES


async def _check(docs, items):
    assert len(docs) == len(items)
    for (_, name), doc in zip(items, docs):
        assert doc.status == "ok", (name, doc.error)
        assert reads_as(name, doc.text), (name, doc.text)
    counts = db_count([d.request_id for d in docs])
    assert len(counts) == len(docs) and set(counts.values()) == {1}


async def test_sigkill_each_stage_mid_run_loses_nothing(fault_pipeline):
    p = fault_pipeline
    items = distinct_images(120, "KILL")
    run = asyncio.create_task(p.run(items, timeout=900))
    for name in STAGES:
        await asyncio.sleep(2.0)
        [st] = [s for s in p.stages[name] if s.proc.poll() is None]
        p.stop(st, sig=signal.SIGKILL)
        await asyncio.sleep(0.5)
        p.start(name)
    await _check(await run, items)


async def test_sigterm_drains_and_exits_within_the_bound(fault_pipeline):
    p = fault_pipeline
    items = distinct_images(80, "TERM")
    run = asyncio.create_task(p.run(items, timeout=900))
    for name in STAGES:
        await asyncio.sleep(1.5)
        [st] = [s for s in p.stages[name] if s.proc.poll() is None]
        t0 = time.monotonic()
        code = p.stop(st, sig=signal.SIGTERM, timeout=60)
        took = time.monotonic() - t0
        assert code == 0, f"{name} exited {code}"
        assert took < 15 + 12, f"{name} took {took:.1f}s to stop (bound 15 s + client close)"
        assert "stopped" in st.log.read_text()
        p.start(name)
    await _check(await run, items)


async def test_second_infer_joins_and_first_leaves_mid_run(fault_pipeline):
    """Rebalances mid-batch: the old owner never commits for lost partitions; one row per request."""
    p = fault_pipeline
    items = distinct_images(80, "REBALANCE")
    run = asyncio.create_task(p.run(items, timeout=900))
    await asyncio.sleep(2.0)
    [first] = [s for s in p.stages["infer"] if s.proc.poll() is None]
    p.start("infer")  # joins the group: partitions move while the first is mid-batch
    await asyncio.sleep(3.0)
    assert p.stop(first, sig=signal.SIGTERM, timeout=60) == 0  # leaves mid-run
    await _check(await run, items)
