"""Exactly one inference per unique image; waiters never left hanging; generations (issue: dedup)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import pytest

from schemas.keys import split_cache_key
from services.common.settings import CommonSettings
from tests.conftest import REPO, SAMPLES, text_image
from tests.stack import db_rows, metric_value, namespaced_pipeline


@pytest.fixture(scope="module")
def sf_pipeline(stack_env, tmp_path_factory):
    """A pipeline of its own (own topics and Redis prefix)."""
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
    # flight and wait for it (single flight proper), not just a cache entry already written
    assert joined > 0, (joined, hit)


async def test_waiters_complete_when_the_holders_infer_is_killed(sf_pipeline):
    data = (SAMPLES / "sroie_152.jpg").read_bytes()
    [infer] = [s for s in sf_pipeline.stages["infer"] if s.proc.poll() is None]
    seen = metric_value(sf_pipeline.metrics("infer"), "ocrstream_messages_in_total")
    task = asyncio.create_task(sf_pipeline.run([(data, "holder.jpg")], timeout=300))
    deadline = time.time() + 60
    while metric_value(sf_pipeline.metrics("infer"), "ocrstream_messages_in_total") == seen:
        assert time.time() < deadline, "infer never received the request"
        await asyncio.sleep(0.05)
    sf_pipeline.stop(infer, sig=9)  # the lease holder dies mid-inference; its offset is not committed
    joined = metric_value(sf_pipeline.metrics("dedup"), "ocrstream_cache_total", outcome="joined")
    waiters = asyncio.create_task(sf_pipeline.run([(data, f"copy-{i}.jpg") for i in range(5)], timeout=300))
    deadline = time.time() + 60
    while metric_value(sf_pipeline.metrics("dedup"), "ocrstream_cache_total", outcome="joined") < joined + 5:
        assert time.time() < deadline, "the copies never joined the dead holder"
        await asyncio.sleep(0.05)
    sf_pipeline.start("infer")  # the holder's event is redelivered; its result completes the waiters
    [holder] = await task
    copies = await waiters
    texts = {d.text for d in [holder, *copies]}
    assert holder.status == "ok" and all(c.status == "ok" for c in copies)
    assert len(texts) == 1 and "WATSONS" in holder.text.upper()
    assert not holder.cache_hit and all(c.cache_hit for c in copies)  # completed with the holder's result
    # the restarted infer computed the redelivered holder only: no copy was sent to inference
    assert metric_value(sf_pipeline.metrics("infer"), "ocrstream_messages_in_total") == 1


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
    assert "deleted 1 cache entry of 1 generation" in out.stdout
    unknown = subprocess.run([sys.executable, "-m", "services.cli", "cache", "purge", "--model", "no-such-rev"], cwd=REPO,
                             capture_output=True, text=True)
    assert unknown.returncode == 1 and "no cache generation has model revision 'no-such-rev'" in unknown.stderr, unknown
    # the dedup LRU still holds the entry: restart dedup so only Redis decides
    for st in sf_pipeline.stages["dedup"]:
        sf_pipeline.stop(st)
    sf_pipeline.start("dedup", extra)
    [after] = await sf_pipeline.run([(data, "rev.png")])
    assert not after.cache_hit and sf_pipeline.engine_calls() == calls + 2


def _redis():
    import redis

    s = CommonSettings()
    return redis.Redis.from_url(s.redis.url), s.redis.key_prefix


def _purge(revision: str) -> int:
    out = subprocess.run([sys.executable, "-m", "services.cli", "cache", "purge", "--model", revision], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    m = re.search(r"deleted (\d+) cache entr(?:y|ies)", out.stdout)
    assert m, out.stdout + out.stderr
    return int(m.group(1))


def _restart(p, name: str, extra: dict[str, str] | None = None) -> None:
    for st in p.stages[name]:
        p.stop(st)
    p.start(name, extra)


async def test_purge_finds_entries_made_after_an_earlier_purge_without_a_restart(sf_pipeline):
    r, prefix = _redis()
    [a] = await sf_pipeline.run([(text_image(["PURGE ONE 101"]), "a.png")])
    gid, _ = split_cache_key(a.cache_key)
    revision = a.model_revision

    def entries() -> int:
        return sum(1 for _ in r.scan_iter(match=f"{prefix}:c:{gid}:*", count=1000))

    before = entries()
    assert before >= 1 and r.exists(f"{prefix}:c:{a.cache_key}")
    assert _purge(revision) == before and entries() == 0
    # dedup keeps running the purged revision: its new entries must be purgeable too
    [b] = await sf_pipeline.run([(text_image(["PURGE TWO 202"]), "b.png")])
    assert not b.cache_hit and split_cache_key(b.cache_key)[0] == gid and b.model_revision == revision
    assert entries() == 1 and r.exists(f"{prefix}:c:{b.cache_key}")
    assert _purge(revision) == 1 and entries() == 0
    assert r.hexists(f"{prefix}:gens", gid)  # the record stays for the next purge


async def test_a_result_of_another_generation_completes_its_waiters_but_is_not_cached(sf_pipeline):
    """Rolling upgrade: dedup keys requests with its generation, an infer of another revision
    computes them. The requests and their waiters complete; nothing is stored under the key."""
    r, prefix = _redis()
    [probe] = await sf_pipeline.run([(text_image(["GENERATION PROBE 1"]), "probe.png")])
    current = probe.model_revision
    _restart(sf_pipeline, "infer", {"OCRSTREAM_ENGINE__MODEL_REVISION": "rev-old"})
    try:
        text = f"ROLLING UPGRADE {time.time_ns() % 1_000_000:06d}"  # results rows outlive the namespace
        data = text_image([text])
        docs = await sf_pipeline.run([(data, f"copy-{i}.png") for i in range(3)])  # one leads, others may wait
        assert [d.status for d in docs] == ["ok"] * 3
        assert {d.text for d in docs} == {text} and {d.model_revision for d in docs} == {"rev-old"}
        [key] = {d.cache_key for d in docs}
        assert split_cache_key(key)[0] == split_cache_key(probe.cache_key)[0]  # dedup's generation
        assert all(d.result_uri is None for d in docs)
        assert not r.exists(f"{prefix}:c:{key}")
        assert db_rows("SELECT COUNT(*) AS n FROM results WHERE cache_key = %s", key)[0]["n"] == 0
        assert metric_value(sf_pipeline.metrics("infer"), "ocrstream_cache_total", outcome="generation_mismatch") >= 1
        calls = sf_pipeline.engine_calls()
        [again] = await sf_pipeline.run([(data, "again.png")])
        assert again.status == "ok" and not again.cache_hit and sf_pipeline.engine_calls() == calls + 1
    finally:
        _restart(sf_pipeline, "infer", {"OCRSTREAM_ENGINE__MODEL_REVISION": current})
    [fixed] = await sf_pipeline.run([(data, "fixed.png")])
    assert fixed.model_revision == current and not fixed.cache_hit and r.exists(f"{prefix}:c:{fixed.cache_key}")


async def test_source_ttl_wins_over_task_ttl_on_the_stored_entry(sf_pipeline):
    r, prefix = _redis()
    _restart(sf_pipeline, "sink", {"OCRSTREAM_CACHE_TTL_BY_TASK": '{"ocr": 7200}',
                                   "OCRSTREAM_CACHE_TTL_BY_SOURCE": '{"screenshot": 600}'})
    try:
        [shot] = await sf_pipeline.run([(text_image(["TTL SCREENSHOT 31"]), "shot.png")], source="screenshot")
        [doc] = await sf_pipeline.run([(text_image(["TTL DOCUMENT 32"]), "doc.png")], source="upload")
    finally:
        _restart(sf_pipeline, "sink")
    shot_ttl = r.pttl(f"{prefix}:c:{shot.cache_key}")
    doc_ttl = r.pttl(f"{prefix}:c:{doc.cache_key}")
    assert 500_000 < shot_ttl <= 600_000, shot_ttl  # source and task both apply: the source's 600 s
    assert 7_000_000 < doc_ttl <= 7_200_000, doc_ttl  # only the task's 7200 s applies
