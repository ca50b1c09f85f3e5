"""Dedup's handler over an in-memory Redis stand-in (pure logic: no S3, no changelog): the tiers,
single flight without Redis, settlement, and rollback of a failed call. The same rules run on the
real stack in ``tests/integration/test_single_flight*.py``."""

from __future__ import annotations

import asyncio

import orjson
from aiokafka import ConsumerRecord

from schemas.events import RequestEvent, SettledEvent
from services.common.cache import CacheEntry, CacheUnavailable
from services.common.events import dumps
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from services.dedup.handler import DedupHandler
from services.dedup.settings import DedupSettings

S = DedupSettings()
SHA = "ab" * 32


class CountingCache:
    """Counts Redis calls; ``entry`` is what a GET finds; ``down`` makes every call fail."""

    def __init__(self, entry: CacheEntry | None = None, down: bool = False):
        self.entry = entry
        self.down = down
        self.calls: list[str] = []

    async def register_generation(self, gen) -> None:
        self.calls.append("register_generation")
        if self.down:
            raise CacheUnavailable("down")

    async def get_with_ttl(self, key):
        self.calls.append("get")
        if self.down:
            raise CacheUnavailable("down")
        return self.entry, 30_000 if self.entry else None


def handler(cache) -> DedupHandler:
    return DedupHandler(S, cache, Telemetry("dedup", TelemetrySettings()))


def request(rid: str) -> RequestEvent:
    return RequestEvent(request_id=rid, content_sha256=SHA, image_uri=f"s3://b/images/{SHA}", size_bytes=10)


def record(topic: str, value: bytes, offset: int = 0) -> ConsumerRecord:
    return ConsumerRecord(topic, 0, offset, 0, 0, None, value, None, 0, 0, [])


def handle(h: DedupHandler, *values: tuple[str, bytes]) -> list[tuple[str, dict]]:
    out = asyncio.run(h.handle([record(t, v, i) for i, (t, v) in enumerate(values)]))
    return [(m.topic, orjson.loads(m.value)) for m in out]


def test_a_repeat_within_the_lru_ttl_is_answered_without_any_redis_call():
    cache = CountingCache(CacheEntry("s3://b/results/x.json", 2, 10, 1))
    h = handler(cache)
    [(topic, ev)] = handle(h, (S.topics.requests, dumps(request("first"))))
    assert topic == S.topics.results and ev["cache_hit"] and ev["result_uri"] == "s3://b/results/x.json"
    assert ev["cache_tier"] == "redis" and cache.calls == ["register_generation", "get"]
    [(topic, ev)] = handle(h, (S.topics.requests, dumps(request("second"))))
    assert topic == S.topics.results and ev["cache_tier"] == "lru" and ev["request"]["request_id"] == "second"
    assert cache.calls == ["register_generation", "get"]  # the LRU answered: Redis was not called


def test_with_redis_down_copies_still_meet_and_the_settlement_answers_them():
    h = handler(CountingCache(down=True))
    out = handle(h, *[(S.topics.requests, dumps(request(f"r{i}"))) for i in range(3)])
    assert [(t, ev["request"]["request_id"]) for t, ev in out] == [(S.topics.infer, "r0")]
    key = out[0][1]["cache_key"]
    settled = SettledEvent(cache_key=key, content_sha256=SHA, request_id="r0", status="ok",
                           result_uri="s3://b/results/doc.json", engine="rapidocr")
    out = handle(h, (S.topics.settled, dumps(settled)))
    assert [(t, ev["request"]["request_id"], ev["cache_tier"], ev["result_uri"]) for t, ev in out] == [
        (S.topics.results, "r1", "single_flight", "s3://b/results/doc.json"),
        (S.topics.results, "r2", "single_flight", "s3://b/results/doc.json")]
    [(topic, ev)] = handle(h, (S.topics.requests, dumps(request("r3"))))  # right after: the settled window
    assert topic == S.topics.results and ev["cache_tier"] == "settled"


def test_a_failed_call_leaves_the_state_as_it_was():
    h = handler(CountingCache(down=True))
    try:
        handle(h, (S.topics.requests, dumps(request("r0"))), (S.topics.requests, b"not json"))
    except Exception:  # noqa: BLE001 - the runner would now retry the records one by one
        pass
    else:
        raise AssertionError("a record that is not JSON must fail the call")
    [(topic, ev)] = handle(h, (S.topics.requests, dumps(request("r0"))))
    assert topic == S.topics.infer and ev["request"]["request_id"] == "r0"  # not taken for a replay
