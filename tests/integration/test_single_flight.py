"""Exactly one inference per unique image; waiters never left hanging; generations (issue: dedup)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, SAMPLES, text_image
from tests.stack import metric_value, namespaced_pipeline


@pytest.fixture(scope="module")
def sf_pipeline(stack_env, tmp_path_factory):
    """A pipeline of its own (own topics and Redis prefix), default (long) in-flight lease."""
    with namespaced_pipeline(tmp_path_factory.mktemp("sf-logs")) as p:
        yield p


async def test_thousand_requests_over_hundred_images_cost_hundred_inferences(sf_pipeline):
    images = {f"INVOICE {1000 + i}": text_image([f"INVOICE {1000 + i}"]) for i in range(100)}
    items = [(data, f"{text}.png") for text, data in images.items()] * 10  # each image 10 times, all at once
    calls = sf_pipeline.engine_calls()
    before = sf_pipeline.metrics("dedup")
    docs = await sf_pipeline.run(items, timeout=900)
    assert len(docs) == 1000 and len({d.request_id for d in docs}) == 1000
    assert sf_pipeline.engine_calls() - calls == 100
    for (data, name), doc in zip(items, docs):
        assert doc.status == "ok", doc.error
        assert doc.text == name.removesuffix(".png"), (name, doc.text)
    hits = sum(d.cache_hit for d in docs)
    assert hits == 900
    dedup = sf_pipeline.metrics("dedup")
    joined, hit = (metric_value(dedup, "ocrstream_cache_total", outcome=o)
                   - metric_value(before, "ocrstream_cache_total", outcome=o) for o in ("joined", "hit"))
    assert joined + hit >= 900
    # all copies arrive together, far faster than 100 inferences: some copies find their twin in
    # flight and join its lease (single flight proper), not just a cache entry already written
    assert joined > 0, (joined, hit)


async def test_waiters_complete_when_the_lease_holder_is_killed(sf_pipeline):
    data = (SAMPLES / "sroie_152.jpg").read_bytes()
    [infer] = [s for s in sf_pipeline.stages["infer"] if s.proc.poll() is None]
    seen = metric_value(sf_pipeline.metrics("infer"), "ocrstream_messages_in_total")
    task = asyncio.create_task(sf_pipeline.run([(data, "holder.jpg")], timeout=300))
    deadline = time.time() + 60
    while metric_value(sf_pipeline.metrics("infer"), "ocrstream_messages_in_total") == seen:
        assert time.time() < deadline, "infer never received the request"
        await asyncio.sleep(0.05)
    sf_pipeline.stop(infer, sig=9)  # the lease holder dies mid-inference; its offset is not committed
    waiters = asyncio.create_task(sf_pipeline.run([(data, f"copy-{i}.jpg") for i in range(5)], timeout=300))
    await asyncio.sleep(3)
    sf_pipeline.start("infer")  # the holder's event is redelivered; its result completes the waiters
    [holder] = await task
    copies = await waiters
    texts = {d.text for d in [holder, *copies]}
    assert holder.status == "ok" and all(c.status == "ok" for c in copies)
    assert len(texts) == 1 and "WATSONS" in holder.text.upper()


async def test_model_revision_change_is_a_miss_and_purge_removes_a_generation(sf_pipeline):
    data = text_image(["REVISION TEST 555"])
    [first] = await sf_pipeline.run([(data, "rev.png")])
    [again] = await sf_pipeline.run([(data, "rev.png")])
    assert not first.cache_hit and again.cache_hit
    # upgrade: dedup and infer restarted with a new model revision
    for name in ("dedup", "infer"):
        for st in sf_pipeline.stages[name]:
            sf_pipeline.stop(st)
    extra = {"OCRSTREAM_ENGINE__MODEL_REVISION": "rev-2"}
    sf_pipeline.start("dedup", extra)
    sf_pipeline.start("infer", extra)
    calls = sf_pipeline.engine_calls()
    [upgraded] = await sf_pipeline.run([(data, "rev.png")])
    assert not upgraded.cache_hit and upgraded.model_revision == "rev-2"
    assert upgraded.cache_key != first.cache_key and upgraded.text == first.text
    assert sf_pipeline.engine_calls() == calls + 1
    [cached] = await sf_pipeline.run([(data, "rev.png")])
    assert cached.cache_hit
    out = subprocess.run([sys.executable, "-m", "services.cli", "cache", "purge", "--model", "rev-2"], cwd=REPO,
                         capture_output=True, text=True, check=True)
    assert "deleted 1 cache entries" in out.stdout
    # the dedup LRU still holds the entry: restart dedup so only Redis decides
    for st in sf_pipeline.stages["dedup"]:
        sf_pipeline.stop(st)
    sf_pipeline.start("dedup", extra)
    [after] = await sf_pipeline.run([(data, "rev.png")])
    assert not after.cache_hit and sf_pipeline.engine_calls() == calls + 2
