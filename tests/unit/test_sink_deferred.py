"""The sink's deferred completions (waiters of a holder that finished while Redis was down), with
small in-memory stand-ins for Redis, S3 and MariaDB (no services)."""

from __future__ import annotations

import asyncio

import pymysql

from schemas.events import Line, Page, RequestEvent, ResultEvent
from services.common.cache import CacheUnavailable
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from services.sink.handler import SinkHandler
from services.sink.settings import SinkSettings

SHA = "a" * 64
KEY = f"gen:{SHA}"


class Cache:
    """complete_begin/complete_end over one key's waiter list; raises while ``up`` is False."""

    def __init__(self, waiters: list[RequestEvent]):
        self.up = False
        self.entry = None
        self.waiters = [w.model_dump_json(by_alias=True).encode() for w in waiters]

    async def complete_begin(self, key, entry, ttl_s, holder=""):
        if not self.up:
            raise CacheUnavailable("down")
        self.entry = entry if entry is not None else self.entry
        return list(self.waiters)

    async def complete_end(self, key, n):
        del self.waiters[:n]

    async def close(self):
        pass


class Store:
    bucket = "b"

    def uri(self, key, bucket=None):
        return f"s3://b/{key}"

    async def put(self, *args, **kwargs):
        pass


class Db:
    """The request rows; every write raises while ``up`` is False."""

    def __init__(self):
        self.up = True
        self.rows: dict[str, object] = {}

    async def write_result(self, **kwargs):
        if not self.up:
            raise pymysql.OperationalError(2003, "down")

    async def write_requests(self, docs):
        if not self.up:
            raise pymysql.OperationalError(2003, "down")
        for d in docs:
            self.rows.setdefault(d.request_id, d)

    async def get_requests(self, ids):
        return {i: self.rows[i] for i in ids if i in self.rows}


class Record:
    def __init__(self, value: bytes):
        self.value, self.headers, self.key = value, [], SHA.encode()
        self.topic, self.partition, self.offset, self.timestamp = "ocr.results", 0, 0, 0


def test_waiters_deferred_while_redis_was_down_survive_a_failed_write_when_it_returns():
    """Redis down while the holder's result is handled: its waiter is deferred. Redis back but
    MariaDB down: the pass that begins the completion fails; the waiter must stay deferred and be
    completed by the next pass, not dropped (the entry is already cached by then, so nothing else
    would ever complete it)."""
    holder = RequestEvent(request_id="H", content_sha256=SHA, image_uri="s3://b/images/aa/x")
    waiter = RequestEvent(request_id="W", content_sha256=SHA, image_uri="s3://b/images/aa/x")
    cache, db = Cache([waiter]), Db()
    h = SinkHandler(SinkSettings(), Store(), db, cache, Telemetry("sink", TelemetrySettings()))
    ev = ResultEvent(request=holder, cache_key=KEY, status="ok", engine="e", model="m", model_revision="r",
                     pages=[Page(index=1, width=10, height=10)],
                     lines=[Line(text="HELLO", box=[[0, 0], [1, 0], [1, 1], [0, 1]], confidence=0.9)])
    out = asyncio.run(h.handle([Record(ev.model_dump_json(by_alias=True).encode())]))
    assert [o.key for o in out if o.topic.endswith("completed")] == ["H"] and list(h._deferred) == [KEY]

    cache.up, db.up = True, False
    try:
        asyncio.run(h.on_idle())
        raise AssertionError("the write should have failed")
    except pymysql.OperationalError:
        pass
    assert list(h._deferred) == [KEY] and cache.entry is not None

    db.up = True
    out = asyncio.run(h.on_idle())
    assert [o.key for o in out] == ["W"] and db.rows["W"].text == "HELLO" and db.rows["W"].cache_hit
    assert h._deferred == {}
    asyncio.run(h.after_produce())
    assert cache.waiters == []


def test_a_deferred_key_with_nobody_waiting_is_released_in_the_same_pass():
    """Nothing to produce means the runner will not call after_produce: the lease is released by
    the pass itself, not left for the next batch's after_produce (by when the reaper may have
    given the key to a new holder, whose lease that late release would delete)."""
    holder = RequestEvent(request_id="H", content_sha256=SHA, image_uri="s3://b/images/aa/x")
    cache, db = Cache([]), Db()
    ended: list[tuple[str, int]] = []

    async def complete_end(key, n):
        ended.append((key, n))

    cache.complete_end = complete_end
    h = SinkHandler(SinkSettings(), Store(), db, cache, Telemetry("sink", TelemetrySettings()))
    ev = ResultEvent(request=holder, cache_key=KEY, status="ok", engine="e", model="m", model_revision="r",
                     pages=[Page(index=1, width=10, height=10)],
                     lines=[Line(text="HELLO", box=[[0, 0], [1, 0], [1, 1], [0, 1]], confidence=0.9)])
    asyncio.run(h.handle([Record(ev.model_dump_json(by_alias=True).encode())]))
    cache.up = True
    assert asyncio.run(h.on_idle()) == []
    assert ended == [(KEY, 0)] and h._pending_end == {} and h._deferred == {}
