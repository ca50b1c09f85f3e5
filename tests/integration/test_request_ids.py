"""Request ids on the real stack, at both doors and across them: ids outside the rule end under a
derived id (never cut onto another id), the same id with other content is ``request_id_conflict``
wherever it comes from, and the first request keeps its id and its own text; ``total`` counts the
ingest queue when a Kafka submission carries no ``submitted_at_ms``."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import random
import time
import uuid

import httpx
import orjson
import pytest
from aiokafka import TopicPartition

from schemas.errors import ErrorCode
from schemas.events import CompletedEvent, DlqEvent, ResultDocument, SubmitEvent
from services.common.results.completions import CompletionWatcher
from services.common.codec import derived_request_id, dumps
from services.common.kafka import make_consumer, make_producer
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.stack import db_rows

pytestmark = pytest.mark.stack


class KafkaDoor:
    """Raw records onto this namespace's ``ocr.submit``; completions collected from ``ocr.completed``."""

    def __init__(self):
        self.s = CommonSettings()
        self.watcher = CompletionWatcher(self.s)
        self.producer = make_producer(self.s.kafka, "test-request-ids")

    async def __aenter__(self) -> "KafkaDoor":
        await self.watcher.start()  # before anything is sent: no completion is missed
        await self.producer.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.producer.stop()
        await self.watcher.stop()

    async def send(self, value: bytes, key: bytes | None = None):
        """Publish one raw value; returns its RecordMetadata (partition, offset, timestamp)."""
        return await self.producer.send_and_wait(self.s.topics.submit, value, key=key)

    def derived(self, md) -> str:
        return derived_request_id(self.s.topics.submit, md.partition, md.offset)

    async def collect(self, ids: set[str], timeout: float = 180) -> dict[str, ResultDocument]:
        done: dict[str, ResultDocument] = {}

        async def run():
            async for ev in self.watcher.completions(ids):
                done[ev.request_id] = ev.result

        try:
            await asyncio.wait_for(run(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"no completion for {ids - set(done)} in {timeout}s") from None
        return done


def printable_tag() -> str:
    """6 random digits for request ids and object keys (printed text is fixed: a plumbing test never
    asserts the OCR of random text)."""
    return "".join(random.choice("23456789") for _ in range(6))


def reads(text: str, printed: str) -> bool:
    """True if the OCR ``text`` is ``printed``, spaces and a stray colon aside and O/0, I/1 alike (the
    engine's occasional slips, e.g. ``UPLOADED : 392683``; which request got which image is what these
    tests check)."""
    def norm(t: str) -> str:
        return t.upper().replace(" ", "").replace(":", "").replace("O", "0").replace("I", "1")
    return norm(text) == norm(printed)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _submit(rid: str | None, data: bytes, **extra) -> bytes:
    return dumps(SubmitEvent(request_id=rid, image_b64=_b64(data), **extra))


async def _topic_counts(topic: str, ids: set[str], model) -> dict[str, int]:
    """How many events on ``topic`` (read from the start to its current end) name each of ``ids``."""
    s = CommonSettings()
    consumer = make_consumer(s.kafka, [], None, "test-request-ids-scan")
    await consumer.start()
    counts = dict.fromkeys(ids, 0)
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or set()]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        async def behind() -> bool:
            return any([await consumer.position(tp) < ends[tp] for tp in tps])

        while await behind():
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                for r in recs:
                    rid = model.model_validate_json(r.value).request_id
                    if rid in counts:
                        counts[rid] += 1
    finally:
        await consumer.stop()
    return counts


def _claim(rid: str) -> dict | None:
    rows = db_rows("SELECT content_sha256, task, door, api_key_id FROM request_claims WHERE request_id = %s", rid)
    return rows[0] if rows else None


async def _claimed(rid: str, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while (row := _claim(rid)) is None:
        assert time.time() < deadline, f"{rid} was never claimed"
        await asyncio.sleep(0.1)
    return row


async def test_ids_outside_the_rule_end_under_their_derived_ids_and_the_next_goes_through(pipeline):
    uid = uuid.uuid4().hex[:8]
    long = f"long-{uid}-" + "x" * 60  # 65+ characters: its first 64 would be another id
    assert len(long) > 64
    img = _b64(text_image(["NEVER READ 232363"]))
    bad = {
        # JSON with a lone surrogate escape: orjson refuses the whole record
        "surrogate": b'{"schema": "ocr.submit.v1", "request_id": "lone-\\ud800-' + uid.encode() + b'", "image_b64": "'
                     + img.encode() + b'"}',
        "long": orjson.dumps({"request_id": long, "image_b64": img}),
        "control": orjson.dumps({"request_id": f"bell\x07{uid}", "image_b64": img}),
        "newline": orjson.dumps({"request_id": f"nl-{uid}\n", "image_b64": img}),
        "space": orjson.dumps({"request_id": f"a b {uid}", "image_b64": img}),
    }
    good_rid = f"after-bad-ids-{uid}"
    async with KafkaDoor() as door:
        derived = {}
        for name, value in bad.items():
            md = await door.send(value, key=long[:64].encode())  # keyed like another request: never used
            derived[name] = door.derived(md)
        await door.send(_submit(good_rid, text_image(["AFTER BAD IDS 866436"])))
        docs = await door.collect(set(derived.values()) | {good_rid})
    assert docs[good_rid].status == "ok" and reads(docs[good_rid].text, "AFTER BAD IDS 866436")
    for name, rid in derived.items():
        doc = docs[rid]
        assert doc.status == "error" and doc.error.code is ErrorCode.INVALID_REQUEST, (name, doc.error)
        assert "not a valid request id" in doc.error.message or "not JSON" in doc.error.message, (name, doc.error)
        [row] = db_rows("SELECT status, error_code FROM requests WHERE request_id = %s", rid)
        assert row == {"status": "error", "error_code": "invalid_request"}
    assert "not JSON" in docs[derived["surrogate"]].error.message
    assert f"({len(long)} characters)" in docs[derived["long"]].error.message
    # nothing under the cut id (nor the key), and nothing claimed by the refused ids
    assert db_rows("SELECT request_id FROM requests WHERE request_id IN (%s, %s)", long[:64], long) == []
    assert _claim(long[:64]) is None
    s = CommonSettings()
    counts = await _topic_counts(s.topics.completed, set(derived.values()) | {long[:64]}, CompletedEvent)
    assert counts == {**dict.fromkeys(derived.values(), 1), long[:64]: 0}
    dlq = await _topic_counts(s.topics.dlq, set(derived.values()), DlqEvent)  # each DLQ event names its derived id
    assert dlq == dict.fromkeys(derived.values(), 1)


async def test_the_same_id_with_another_image_on_the_kafka_door_is_a_conflict_and_the_first_keeps_its_text(pipeline):
    tag = printable_tag()
    rid = f"kafka-dup-{tag}-{uuid.uuid4().hex[:8]}"
    first, other = text_image(["FIRST KAFKA 276389"]), text_image(["OTHER KAFKA 567425"])
    async with KafkaDoor() as door:
        await door.send(_submit(rid, first), key=rid.encode())
        held = await _claimed(rid)
        assert held == {"content_sha256": hashlib.sha256(first).hexdigest(), "task": "ocr", "door": "kafka",
                        "api_key_id": None}
        clash = door.derived(await door.send(_submit(rid, other), key=rid.encode()))
        # a broken record naming the same id must not end it either
        broken = door.derived(await door.send(orjson.dumps({"request_id": rid, "image_uri": "ftp://nope"}),
                                              key=rid.encode()))
        retry = door.derived(await door.send(_submit(rid, first), key=rid.encode()))  # same image: a retry
        after = f"kafka-dup-next-{tag}-{uuid.uuid4().hex[:8]}"
        await door.send(_submit(after, text_image(["NEXT KAFKA 527684"])))
        docs = await door.collect({rid, clash, broken, after})
    assert docs[rid].status == "ok" and reads(docs[rid].text, "FIRST KAFKA 276389")
    assert docs[rid].content_sha256 == hashlib.sha256(first).hexdigest()
    c = docs[clash]
    assert c.status == "error" and c.error.code is ErrorCode.REQUEST_ID_CONFLICT
    assert c.error.message.startswith(f"request_id {rid!r} is already used for a different image")
    assert f"ends under its derived request id {clash}" in c.error.message
    b = docs[broken]
    assert b.error.code is ErrorCode.INVALID_REQUEST and f"request_id {rid!r} is already used" in b.error.message
    assert reads(docs[after].text, "NEXT KAFKA 527684")
    [row] = db_rows("SELECT status, content_sha256 FROM requests WHERE request_id = %s", rid)
    assert row == {"status": "ok", "content_sha256": hashlib.sha256(first).hexdigest()}
    [row] = db_rows("SELECT error_code FROM requests WHERE request_id = %s", clash)
    assert row == {"error_code": "request_id_conflict"}
    assert _claim(rid)["content_sha256"] == hashlib.sha256(first).hexdigest()  # never overwritten
    assert db_rows("SELECT request_id FROM requests WHERE request_id = %s", retry) == []  # the retry ended nothing new
    counts = await _topic_counts(CommonSettings().topics.completed, {rid}, CompletedEvent)
    assert counts[rid] >= 1 and db_rows("SELECT COUNT(*) AS n FROM requests WHERE request_id = %s", rid) == [{"n": 1}]


async def test_a_kafka_pending_id_reused_at_the_http_door_with_another_image_is_409(api):
    tag = printable_tag()
    rid = f"kafka-then-http-{tag}-{uuid.uuid4().hex[:8]}"
    first, other = text_image(["KAFKA FIRST 543252"]), text_image(["HTTP OTHER 352422"])
    png = {"Content-Type": "image/png"}
    async with KafkaDoor() as door:
        await door.send(_submit(rid, first), key=rid.encode())
        await _claimed(rid)
        with httpx.Client(base_url=api.url, timeout=90) as c:
            r = c.post("/v1/ocr", content=other, headers=png, params={"request_id": rid})
            assert r.status_code == 409, r.text
            assert r.json()["error"]["code"] == "request_id_conflict"
            assert r.json()["error"]["message"].startswith(f"request_id {rid!r} is already used for a different image")
            pending = c.get(f"/v1/ocr/{rid}")  # known while pending: its claim, though Redis never heard of it
            assert pending.status_code == 200 and pending.json()["status"] in ("pending", "ok"), pending.text
            same = c.post("/v1/ocr", content=first, headers=png, params={"request_id": rid})  # a retry (keys off)
            assert same.status_code in (200, 202) and same.json()["request_id"] == rid, same.text
            got = c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()
        docs = await door.collect({rid})
    assert got["status"] == "ok" and reads(got["result"]["text"], "KAFKA FIRST 543252")
    assert reads(docs[rid].text, "KAFKA FIRST 543252")
    assert _claim(rid)["door"] == "kafka"


async def test_an_http_id_reused_on_the_kafka_door_with_another_image_is_a_conflict(api):
    tag = printable_tag()
    rid = f"http-then-kafka-{tag}-{uuid.uuid4().hex[:8]}"
    first, other = text_image(["HTTP FIRST 475333"]), text_image(["KAFKA OTHER 725383"])
    async with KafkaDoor() as door:
        with httpx.Client(base_url=api.url, timeout=90) as c:
            r = c.post("/v1/ocr", content=first, headers={"Content-Type": "image/png"}, params={"request_id": rid})
            assert r.status_code == 202, r.text
            assert _claim(rid) == {"content_sha256": hashlib.sha256(first).hexdigest(), "task": "ocr",
                                   "door": "http", "api_key_id": None}
            clash = door.derived(await door.send(_submit(rid, other), key=rid.encode()))
            docs = await door.collect({rid, clash})
            got = c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()
    assert docs[clash].error.code is ErrorCode.REQUEST_ID_CONFLICT and repr(rid) in docs[clash].error.message
    assert docs[rid].status == "ok" and reads(docs[rid].text, "HTTP FIRST 475333")
    assert got["status"] == "ok" and reads(got["result"]["text"], "HTTP FIRST 475333")


@pytest.mark.parametrize("rid,after", [("x" * 65, "AFTER REFUSED 886572"), ("bell\x07id", "AFTER REFUSED 886573"),
                                       ("tab\tid", "AFTER REFUSED 886574"), ("nl-id\n", "AFTER REFUSED 886575"),
                                       ("a b", "AFTER REFUSED 886576"), ("é-id", "AFTER REFUSED 886577")])
def test_ids_outside_the_rule_are_400_at_the_http_door_and_the_next_goes_through(api, rid, after):
    with httpx.Client(base_url=api.url, timeout=90) as c:
        r = c.post("/v1/ocr", content=text_image(["REFUSED 852732"]), headers={"Content-Type": "image/png"},
                   params={"request_id": rid})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_request" and "request_id" in r.json()["error"]["message"]
        ok = c.post("/v1/ocr", content=text_image([after]), headers={"Content-Type": "image/png"})
        assert ok.status_code == 202, ok.text
        got = c.get(f"/v1/ocr/{ok.json()['request_id']}", params={"wait": 60}).json()
    assert got["status"] == "ok" and reads(got["result"]["text"], after)
    assert _claim(rid[:64]) is None


def test_a_lone_surrogate_id_is_400_at_the_http_door(api):
    # %ED%A0%80 is U+D800 in (invalid) UTF-8: the query string cannot carry a lone surrogate as such
    with httpx.Client(base_url=api.url, timeout=90) as c:
        r = c.post(f"{api.url}/v1/ocr?request_id=lone-%ED%A0%80", content=text_image(["LONE"]),
                   headers={"Content-Type": "image/png"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text


async def test_total_counts_the_ingest_queue_from_the_kafka_timestamp_without_submitted_at(pipeline):
    tag = printable_tag()
    rid = f"no-submitted-at-{tag}-{uuid.uuid4().hex[:8]}"
    value = orjson.dumps({"schema": "ocr.submit.v1", "request_id": rid,
                          "image_b64": _b64(text_image(["QUEUE TIMED 449934"]))})
    assert b"submitted_at_ms" not in value
    async with KafkaDoor() as door:
        md = await door.send(value, key=rid.encode())
        doc = (await door.collect({rid}))[rid]
    assert doc.status == "ok" and reads(doc.text, "QUEUE TIMED 449934")
    assert doc.submitted_at_ms == md.timestamp
    t = doc.timings_ms
    assert t["total"] >= t["queue_ingest"] >= 0 and t["total"] > 0
    assert abs(t["total"] - (doc.completed_at_ms - md.timestamp)) <= 2
    [row] = db_rows("SELECT total_ms, submitted_at_ms FROM requests WHERE request_id = %s", rid)
    assert row["submitted_at_ms"] == md.timestamp and row["total_ms"] == t["total"]
