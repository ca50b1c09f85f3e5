"""Dedup's handler over an in-memory Redis stand-in (pure logic: no S3, no changelog): the tiers,
single flight without Redis, settlement, and rollback of a failed call. The same rules run on the
real stack in ``tests/integration/test_single_flight*.py``."""

from __future__ import annotations

import asyncio

import orjson
from aiokafka import ConsumerRecord

from schemas.events import RequestEvent, RequestLogEvent, SettledEvent
from services.common.cache.entries import CacheEntry, CacheUnavailable
from services.common.codec import dumps
from services.common.records import RecordParser
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


DECODE = RecordParser({S.topics.requests: RequestLogEvent})  # as DedupHandler.consumes


def record(topic: str, value: bytes, offset: int = 0):
    return DECODE(ConsumerRecord(topic, 0, offset, 0, 0, None, value, None, 0, 0, []))


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
    out = handle(h, (S.topics.requests, dumps(settled)))
    assert [(t, ev["request"]["request_id"], ev["cache_tier"], ev["result_uri"]) for t, ev in out] == [
        (S.topics.results, "r1", "single_flight", "s3://b/results/doc.json"),
        (S.topics.results, "r2", "single_flight", "s3://b/results/doc.json")]
    [(topic, ev)] = handle(h, (S.topics.requests, dumps(request("r3"))))  # right after: the settled window
    assert topic == S.topics.results and ev["cache_tier"] == "settled"


class FailsSecondGet(CountingCache):
    """Its second GET raises a bug (not an outage); every other call finds nothing."""

    async def get_with_ttl(self, key):
        await super().get_with_ttl(key)
        if self.calls.count("get") == 2:
            raise RuntimeError("a bug in the cache client")
        return None, None


def test_a_failed_call_leaves_the_state_as_it_was():
    h = handler(FailsSecondGet())
    other = request("r1").model_copy(update={"content_sha256": "cd" * 32})
    try:
        handle(h, (S.topics.requests, dumps(request("r0"))), (S.topics.requests, dumps(other)))
    except RuntimeError:  # the runner would now retry the records one by one
        pass
    else:
        raise AssertionError("a record whose handling raises must fail the call")
    [(topic, ev)] = handle(h, (S.topics.requests, dumps(request("r0"))))
    assert topic == S.topics.infer and ev["request"]["request_id"] == "r0"  # not taken for a replay


class MemoryChangelog:
    """The changelog topic in memory: ``write`` appends, ``restore`` replays (tombstones applied)."""

    def __init__(self):
        self.log: dict[int, list[tuple[bytes, bytes | None]]] = {}

    async def restore(self, partitions):
        out = {}
        for p in partitions:
            latest: dict[bytes, bytes] = {}
            for k, v in self.log.get(p, []):
                if v is None:
                    latest.pop(k, None)
                else:
                    latest[k] = v
            out[p] = latest
        return out

    async def write(self, partition, records):
        self.log.setdefault(partition, []).extend(records)


def test_a_poisoned_settlement_on_the_last_attempt_answers_the_copies_kept_in_the_changelog_too():
    """Past ``max_waiters`` copies wait in the changelog only; a settlement that cannot be applied
    (sent to the DLQ) on the holder's last attempt ends every copy, those read back included."""
    s = S.model_copy(update={"max_waiters": 1, "max_attempts": 1})  # the topics record() decodes
    changelog = MemoryChangelog()
    h = DedupHandler(s, CountingCache(down=True), Telemetry("dedup", TelemetrySettings()), changelog=changelog)
    out = asyncio.run(h.handle([record(s.topics.requests, dumps(request(f"r{i}")), i) for i in range(4)]))
    asyncio.run(h.after_produce())  # the batch's changelog records written, as the runner does
    [holder] = [orjson.loads(m.value) for m in out]
    key = holder["cache_key"]
    bad = orjson.dumps({"schema": "ocr.settled.v1", "cache_key": key, "content_sha256": SHA, "request_id": "r0",
                        "status": "bogus"})  # does not decode: the runner poisons it at once
    rec = record(s.topics.requests, bad, 10)
    assert rec.error is not None
    msgs = asyncio.run(h.poison(rec, rec.error, 1))
    answered = sorted(orjson.loads(m.value)["request"]["request_id"] for m in msgs if m.topic == s.topics.results)
    assert answered == ["r1", "r2", "r3"]
    assert [m.topic for m in msgs].count(s.topics.dlq) == 1
    asyncio.run(h.after_produce())
    left = asyncio.run(changelog.restore([0]))[0]
    assert not [k for k in left if k.startswith(b"w|")]  # no copy left waiting in the changelog


class RevokedMidBatch(CountingCache):
    """Redis misses; the first GET is where a revocation (whose drain timed out) lands."""

    def __init__(self):
        super().__init__()
        self.on_first_get = None

    async def get_with_ttl(self, key):
        self.calls.append("get")
        if self.on_first_get is not None:
            hook, self.on_first_get = self.on_first_get, None
            await hook()
        return None, None


def test_a_partition_revoked_during_a_batch_is_not_brought_back_stale():
    from aiokafka import TopicPartition

    tps = {TopicPartition(S.topics.requests, 0)}
    cache, changelog = RevokedMidBatch(), MemoryChangelog()
    h = DedupHandler(S, cache, Telemetry("dedup", TelemetrySettings()), changelog=changelog)
    asyncio.run(h.on_assigned(tps))
    cache.on_first_get = lambda: h.on_revoked(tps)
    other = RequestEvent(request_id="r1", content_sha256="cd" * 32, image_uri="s3://b/x", size_bytes=1)
    # the revocation lands during r0's lookup: r1, of the revoked partition, is not this batch's
    asyncio.run(h.handle([record(S.topics.requests, dumps(request("r0")), 0),
                          record(S.topics.requests, dumps(other), 1)]))
    assert h.states == {}  # nothing of partition 0 is kept (nor restored for r1)
    # meanwhile another member owned partition 0 and settled both keys (its changelog is empty
    # again); partition 0 comes back: restored from the changelog, not from what was kept here
    asyncio.run(h.on_assigned(tps))
    assert h.states[0].inflight == {} and h.states[0].ids == {}
    [(topic, ev)] = handle(h, (S.topics.requests, dumps(request("r2"))))
    assert topic == S.topics.infer and ev["request"]["request_id"] == "r2"  # computed, not left waiting


class FencedStore:
    """S3 with one purge fence (``fences/<gen>.json``) and no stored result documents."""

    def __init__(self, purged_at_ms: int):
        self.purged_at_ms = purged_at_ms

    async def get(self, key):
        assert key.startswith("fences/")
        return orjson.dumps({"purged_at_ms": self.purged_at_ms})

    async def last_modified_ms(self, key):
        return None

    def uri(self, key):
        return f"s3://b/{key}"


def test_a_redis_entry_older_than_the_purge_fence_is_not_answered():
    # `cache purge` with Redis down writes the fence but leaves the entries: they must not answer
    old = CacheEntry("s3://b/results/old.json", 2, 10, created_at_ms=1_000)
    h = DedupHandler(S, CountingCache(old), Telemetry("dedup", TelemetrySettings()), store=FencedStore(5_000))
    [(topic, ev)] = handle(h, (S.topics.requests, dumps(request("r0"))))
    assert topic == S.topics.infer and ev["request"]["request_id"] == "r0"
    new = CacheEntry("s3://b/results/new.json", 2, 10, created_at_ms=6_000)  # computed again after the purge
    h = DedupHandler(S, CountingCache(new), Telemetry("dedup", TelemetrySettings()), store=FencedStore(5_000))
    [(topic, ev)] = handle(h, (S.topics.requests, dumps(request("r1"))))
    assert topic == S.topics.results and ev["cache_tier"] == "redis" and ev["result_uri"] == new.result_uri


def test_a_settlement_sent_to_the_dlq_still_ends_its_key_for_the_waiting_copies():
    h = handler(CountingCache(down=True))
    out = handle(h, *[(S.topics.requests, dumps(request(f"r{i}"))) for i in range(3)])
    key = out[0][1]["cache_key"]
    settled = SettledEvent(cache_key=key, content_sha256=SHA, request_id="r0", status="ok", result_uri="s3://b/d.json")
    msgs = asyncio.run(h.poison(record(S.topics.requests, dumps(settled), 5), RuntimeError("cannot apply"), 3))
    got = [(m.topic, orjson.loads(m.value)) for m in msgs]
    assert [t for t, _ in got] == [S.topics.dlq, S.topics.infer]  # the first waiter computes it again
    assert (got[1][1]["request"]["request_id"], got[1][1]["attempt"]) == ("r1", 2)
    done = SettledEvent(cache_key=key, content_sha256=SHA, request_id="r1", status="ok", result_uri="s3://b/d.json",
                        attempt=2)
    out = handle(h, (S.topics.requests, dumps(done)))
    assert [(ev["request"]["request_id"], ev["cache_tier"]) for _, ev in out] == [("r2", "single_flight")]


def test_a_settlement_without_its_schema_field_is_still_read_as_a_settlement():
    """A producer that leaves ``schema`` out: a settlement has a ``cache_key``, a request never."""
    settled = orjson.loads(dumps(SettledEvent(cache_key="k", content_sha256=SHA, request_id="r0", status="ok",
                                              result_uri="s3://b/d.json")))
    settled.pop("schema")
    req = orjson.loads(dumps(request("r1")))
    req.pop("schema")
    assert isinstance(record(S.topics.requests, orjson.dumps(settled)).value.root, SettledEvent)
    assert isinstance(record(S.topics.requests, orjson.dumps(req)).value.root, RequestEvent)
