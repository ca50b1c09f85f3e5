"""Single flight when a cache hit reaches the sink late, on the real stack.

The door answers a cached image at once and publishes the hit; the sink may read it much later
(a backlog, a restart). By then the cache entry may have expired and another request may hold
the key's lease for a new inference, with copies waiting on it. The late hit must complete its
own request only: the lease and the waiters belong to that inference (sink ``_one``), so copies
arriving meanwhile still join it and the image is inferred once.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
import redis

from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.integration.conftest import API_ENV
from tests.stack import API, db_rows, metric_value, namespaced_pipeline

pytestmark = pytest.mark.stack

SHORT = "late-short"  # a source whose cache entries live 2 s
PNG = {"Content-Type": "image/png"}


@pytest.fixture(scope="module")
def late_pipeline(stack_env, tmp_path_factory):
    """A pipeline of its own (stages get stopped and started here) plus a door."""
    extra = {"OCRSTREAM_CACHE_TTL_BY_SOURCE": f'{{"{SHORT}": 2}}'}
    with namespaced_pipeline(tmp_path_factory.mktemp("late-hit-logs"), extra, partitions=2) as p:
        door = p.start(API, extra_env=API_ENV)
        p.url = f"http://127.0.0.1:{door.port}"
        yield p


def _wait(what: str, check, timeout: float = 60):
    deadline = time.time() + timeout
    while not (got := check()):
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return got


def _live(p, name: str):
    [st] = [s for s in p.stages[name] if s.proc.poll() is None]
    return st


def test_a_late_exact_hit_leaves_another_requests_lease_and_waiters_alone(late_pipeline):
    p = late_pipeline
    r = redis.Redis.from_url(CommonSettings().redis.url)
    prefix = CommonSettings().redis.key_prefix
    img = text_image([f"LATE HIT {uuid.uuid4().hex[:6].upper()}"])
    with httpx.Client(base_url=p.url, timeout=150) as c:
        def submit() -> str:
            res = c.post("/v1/ocr", content=img, headers=PNG)
            assert res.status_code in (200, 202), res.text
            return res.json()["request_id"]

        # computed once; its cache entry lives 2 s
        first = c.get(f"/v1/ocr/{c.post('/v1/ocr', content=img, headers=PNG, params={'source': SHORT}).json()['request_id']}",
                      params={"wait": 120}).json()
        assert first["status"] == "ok", first
        key, text = first["result"]["cache_key"], first["result"]["text"]
        entry, lease, waiters = (f"{prefix}:{k}:{key}" for k in ("c", "lease", "wait"))

        # the sink is down: a cached answer's hit waits on ocr.results
        p.stop(_live(p, "sink"))
        late = c.post("/v1/ocr", content=img, headers=PNG)
        assert late.status_code == 200 and late.json()["cache_hit"] is True, late.text
        late_id = late.json()["request_id"]
        _wait("the entry to expire", lambda: not r.exists(entry), timeout=10)

        # a new inference takes the lease (infer is down, so it stays in flight); a copy joins it
        p.stop(_live(p, "infer"))
        holder = submit()
        _wait("the new lease", lambda: r.get(lease) == holder.encode())
        joined = submit()
        _wait("the copy to join", lambda: r.llen(waiters) == 1)

        # the late hit is read now: it completes its own request and nothing else
        p.start("sink")
        done = c.get(f"/v1/ocr/{late_id}", params={"wait": 60}).json()
        assert done["status"] == "ok" and done["result"]["cache_hit"] is True and done["result"]["text"] == text
        assert r.get(lease) == holder.encode()
        assert r.llen(waiters) == 1
        assert db_rows("SELECT request_id FROM requests WHERE request_id IN (%s, %s)", holder, joined) == []

        # so a copy arriving now still joins the one inference in flight
        another = submit()
        _wait("the second copy to join", lambda: r.llen(waiters) == 2)
        p.start("infer")
        for rid in (holder, joined, another):
            got = c.get(f"/v1/ocr/{rid}", params={"wait": 120}).json()
            assert got["status"] == "ok" and got["result"]["text"] == text, got
        assert metric_value(p.metrics("infer"), "ocrstream_engine_images_total") == 1
        # released once the completions are acknowledged, a moment after clients can see them
        _wait("the lease to be released", lambda: not r.exists(lease) and r.llen(waiters) == 0, timeout=10)
