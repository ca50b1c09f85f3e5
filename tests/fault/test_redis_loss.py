"""Redis is a cache you can lose: stopped for a whole run, flushed, restarted empty, flushed while
copies wait. No request is lost or stuck, copies in flight are computed once, and an image
already read is answered from the S3 tier, never read again.

The pipeline here has a Redis of its own (a real ``redis-server`` on a free loopback port, no
persistence), so it can be stopped and flushed without touching the shared stack's. Dedup's
settled window is 0 s, so a repeat after settlement is answered by Redis or S3, the tiers under test.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time

import pytest
import redis

from tests.conftest import REPO, text_image
from tests.fault.conftest import reads_as
from tests.stack import free_port, metric_value, namespaced_pipeline


class PrivateRedis:
    """A ``redis-server`` on 127.0.0.1:``port`` without persistence (a restart comes back empty)."""

    def __init__(self, logdir):
        self.port = free_port()
        self.logdir = logdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        assert exe, "redis-server is installed by deploy/local/up.sh"
        self.proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no"], stdout=open(self.logdir / "redis.log", "ab"),
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while True:
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                assert time.time() < deadline, "private redis did not start"
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(20)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory):
    r = PrivateRedis(tmp_path_factory.mktemp("private-redis"))
    r.start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def lossy(private_redis, tmp_path_factory):
    extra = {"OCRSTREAM_REDIS__URL": private_redis.url, "OCRSTREAM_SETTLED_WINDOW_S": "0",
             "OCRSTREAM_LRU_ENTRIES": "0", "OCRSTREAM_RETRY_MAX_BACKOFF_S": "2",
             # the S3 tier answers every image here: a HEAD past its 500 ms default on a loaded
             # machine would be a miss and a second inference
             "OCRSTREAM_S3_TIER_TIMEOUT_MS": "5000"}
    with namespaced_pipeline(tmp_path_factory.mktemp("redis-loss-logs"), extra) as p:
        yield p


IMAGES = [(text_image([f"LOSS {i:04d}"]), f"LOSS {i:04d}") for i in range(100)]


def tiers(docs) -> dict[str | None, int]:
    out: dict[str | None, int] = {}
    for d in docs:
        out[d.cache_tier] = out.get(d.cache_tier, 0) + 1
    return out


def assert_own_text(items, docs) -> None:
    assert len(docs) == len(items)
    for (_, name), d in zip(items, docs):
        assert d.status == "ok", (name, d.error)
        assert reads_as(name, d.text), (name, d.text)


async def test_redis_stopped_flushed_and_restarted_costs_no_second_inference(lossy, private_redis):
    p = lossy
    private_redis.stop()  # down for the whole first run
    calls = p.engine_calls()
    items = IMAGES * 10  # each image 10 times, all at once
    docs = await p.run(items, timeout=900)
    assert_own_text(items, docs)
    assert p.engine_calls() - calls == 100
    assert sum(not d.cache_hit for d in docs) == 100

    # Redis back, empty: the S3 tier answers, and Redis is warmed again. First one image of its
    # own, twice, so the stages' circuit breakers (open while Redis was down; a stale pooled
    # connection may fail the first trial call) have closed before the round that is counted
    private_redis.start()
    warm = [(text_image(["LOSS WARM"]), "LOSS WARM")]
    for _ in range(2):
        await p.run(warm, timeout=300)
        await asyncio.sleep(1.5)
    calls += 1
    docs = await p.run(IMAGES, timeout=300)
    assert_own_text(IMAGES, docs)
    assert p.engine_calls() - calls == 100 and tiers(docs) == {"s3": 100}
    r = private_redis.client()
    prefix = os.environ["OCRSTREAM_REDIS__KEY_PREFIX"]
    assert sum(1 for _ in r.scan_iter(match=f"{prefix}:c:*")) == 100 + 1
    docs = await p.run(IMAGES, timeout=300)
    assert tiers(docs) == {"redis": 100}

    # FLUSHALL, then Redis stopped again: S3 each time, no inference
    r.flushall()
    docs = await p.run(IMAGES, timeout=300)
    assert_own_text(IMAGES, docs)
    assert tiers(docs) == {"s3": 100} and p.engine_calls() - calls == 100
    private_redis.stop()
    docs = await p.run(IMAGES, timeout=300)
    assert_own_text(IMAGES, docs)
    assert tiers(docs) == {"s3": 100} and p.engine_calls() - calls == 100

    # purge the generation (Redis down: the S3 fence alone): every image is read again
    gen_id = docs[0].cache_key.split(":", 1)[0]
    out = subprocess.run([sys.executable, "-m", "services.cli", "cache", "purge", "--generation", gen_id], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0 and f"fenced their stored results in S3 ({gen_id})" in out.stdout, out
    assert "did not answer the purge" in out.stderr
    await asyncio.sleep(6)  # dedup re-reads a fence every fence_refresh_s (5 s)
    docs = await p.run(IMAGES, timeout=600)
    assert_own_text(IMAGES, docs)
    assert p.engine_calls() - calls == 200 and not any(d.cache_hit for d in docs)
    private_redis.start()


async def test_flushall_while_copies_wait_completes_every_request_once(lossy, private_redis):
    p = lossy
    [sink] = [s for s in p.stages["sink"] if s.proc.poll() is None]
    p.stop(sink)  # nothing settles until the copies have joined
    items = [(text_image([f"FLUSH {i:04d}"]), f"FLUSH {i:04d}") for i in range(20)] * 3
    joined = metric_value(p.metrics("dedup"), "ocrstream_cache_total", outcome="joined")
    calls = p.engine_calls()
    run = asyncio.create_task(p.run(items, timeout=600))
    deadline = time.time() + 120
    while metric_value(p.metrics("dedup"), "ocrstream_cache_total", outcome="joined") < joined + 40:
        assert time.time() < deadline, "the copies never joined"
        await asyncio.sleep(0.1)
    private_redis.client().flushall()
    p.start("sink")
    docs = await run
    assert_own_text(items, docs)
    assert p.engine_calls() - calls == 20
    assert sorted(d.cache_tier for d in docs if d.cache_hit) == ["single_flight"] * 40
