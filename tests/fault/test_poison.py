"""Poison messages go to ocr.dlq with the reason and original bytes; the partition keeps moving."""

from __future__ import annotations

import asyncio
import base64
import uuid

import orjson
from aiokafka import TopicPartition

from schemas.errors import ErrorCode
from schemas.events import DlqEvent, RequestEvent, ResultEvent, SubmitEvent
from services.common.codec import dumps
from services.common.kafka import make_consumer, make_producer
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.fault.conftest import db_count


async def _dlq_events(s: CommonSettings, want: int, timeout: float = 120) -> list[DlqEvent]:
    consumer = make_consumer(s.kafka, [], None, "test-dlq")
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(s.topics.dlq) or set()
        tps = [TopicPartition(s.topics.dlq, p) for p in parts]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        events: list[DlqEvent] = []
        deadline = asyncio.get_running_loop().time() + timeout
        while len(events) < want and asyncio.get_running_loop().time() < deadline:
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                events += [DlqEvent.model_validate_json(r.value) for r in recs]
        return events
    finally:
        await consumer.stop()


async def test_poison_messages_reach_the_dlq_and_end_their_requests(fault_pipeline):
    s = CommonSettings()
    rid_schema, rid_missing, rid_raises = (f"poison-{uuid.uuid4().hex[:8]}-{k}" for k in ("schema", "missing", "raises"))
    producer = make_producer(s.kafka, "test-poison")
    await producer.start()
    try:
        not_json = b"\x00\x01 this is not json"
        await producer.send_and_wait(s.topics.submit, not_json, key=b"x", headers=[("origin", b"test")])
        await producer.send_and_wait(s.topics.submit, orjson.dumps({"schema": "ocr.submit.v1", "request_id": rid_schema,
                                                                   "image_uri": "ftp://nope"}), key=rid_schema.encode())
        await producer.send_and_wait(s.topics.submit, dumps(SubmitEvent(request_id=rid_missing,
                                     image_uri=f"s3://{s.s3.bucket}/{s.s3.upload_prefix}does-not-exist")), key=rid_missing.encode())
        # A result whose cache key is malformed: the sink raises on it every time.
        bad = ResultEvent(request=RequestEvent(request_id=rid_raises, content_sha256="0" * 64), cache_key="bad-key",
                          status="ok", lines=[], pages=[])
        await producer.send_and_wait(s.topics.results, dumps(bad), key=rid_raises.encode())
    finally:
        await producer.stop()
    [after] = await fault_pipeline.run([(text_image(["AFTER POISON 99"]), "after.png")], timeout=300)
    assert after.status == "ok" and after.text == "AFTER POISON 99"

    events = await _dlq_events(s, 4)
    by_value = {e.value_b64: e for e in events}
    raw = by_value[base64.b64encode(not_json).decode()]
    assert raw.stage == "ingest" and raw.error_code is ErrorCode.INVALID_REQUEST and raw.headers == {"origin": base64.b64encode(b"test").decode()}
    by_rid = {e.request_id: e for e in events if e.request_id}
    assert by_rid[rid_schema].error_code is ErrorCode.INVALID_REQUEST and "image_uri" in by_rid[rid_schema].reason
    assert by_rid[rid_missing].error_code is ErrorCode.MISSING_OBJECT and by_rid[rid_missing].attempts == s.max_attempts
    assert by_rid[rid_raises].stage == "sink" and by_rid[rid_raises].attempts == s.max_attempts
    assert "not a cache key" in by_rid[rid_raises].reason

    for _ in range(300):  # the error results of those requests are written by the sink (60 s at most)
        if len(db_count([rid_schema, rid_missing, rid_raises])) == 3:
            break
        await asyncio.sleep(0.2)
    from services.common.db import Database
    from services.common.results.rows import ResultRows

    docs = await ResultRows(Database(s.mysql, pool_size=1)).get_requests([rid_schema, rid_missing, rid_raises])
    assert docs[rid_schema].error.code is ErrorCode.INVALID_REQUEST
    assert docs[rid_missing].error.code is ErrorCode.MISSING_OBJECT
    assert docs[rid_raises].error.code is ErrorCode.INTERNAL_ERROR
