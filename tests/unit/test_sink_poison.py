"""The sink's poison path (pure logic: the database in memory, no S3 call): a computed result the
sink cannot write still settles its cache key, so the copies waiting on it in dedup are answered."""

from __future__ import annotations

import asyncio

import orjson
from aiokafka import ConsumerRecord

from schemas.events import RequestEvent, ResultEvent, SettledEvent
from schemas.reading import Line, Page
from services.common.codec import dumps
from services.common.records import RecordParser, Record
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from services.sink.handler import SinkHandler
from services.sink.settings import SinkSettings

S = SinkSettings()
SHA = "ab" * 32
KEY = "g1:" + SHA


class MemoryRows:
    """The ``requests`` rows in memory (``ResultRows``' reads and writes): the first final state of a request stays."""

    def __init__(self):
        self.rows = {}

    async def write_requests(self, docs):
        for d in docs:
            self.rows.setdefault(d.request_id, d)
        return {d.request_id: self.rows[d.request_id] for d in docs}

    async def get_requests(self, ids):
        return {i: self.rows[i] for i in ids if i in self.rows}


def record(topic: str, value: bytes) -> Record:
    return RecordParser({S.topics.results: ResultEvent})(ConsumerRecord(topic, 0, 7, 0, 0, None, value, None, 0, 0, []))


def test_a_computed_result_sent_to_the_dlq_still_settles_its_key_with_an_error():
    sink = SinkHandler(S, store=None, db=None, cache=None, telemetry=Telemetry("sink", TelemetrySettings()))
    sink.rows = MemoryRows()
    req = RequestEvent(request_id="holder", content_sha256=SHA, image_uri=f"s3://b/images/{SHA}", size_bytes=10)
    computed = ResultEvent(request=req, cache_key=KEY, status="ok", engine="rapidocr", pages=[Page(index=1, width=4, height=4)],
                           lines=[Line(text="x", page=1, box=[(0, 0), (1, 0), (1, 1), (0, 1)], confidence=0.9)])
    out = sink.poison(record(S.topics.results, dumps(computed)), RuntimeError("row refused"), 3)
    assert [m.topic for m in out] == [S.topics.dlq, S.topics.results]
    # the error result comes back to the sink: the holder's final state, and its key's settlement
    out = asyncio.run(sink.handle([record(S.topics.results, out[1].value)]))
    [settled] = [SettledEvent.model_validate(orjson.loads(m.value)) for m in out if m.topic == S.topics.requests]
    assert (settled.cache_key, settled.request_id, settled.status, settled.error.code.value) == (
        KEY, "holder", "error", "internal_error")
    assert [m.key for m in out if m.topic == S.topics.requests] == [SHA]  # to the key's dedup partition
