"""What the runner hands a handler (no Kafka): decoded records, each with its consumer span, the
undecodable ones through ``Handler.undecodable``, and ``Handler.oversize`` for a message over its
topic's limit."""

from __future__ import annotations

import asyncio

import orjson
from aiokafka import ConsumerRecord

from schemas.errors import ErrorCode
from schemas.events import DlqEvent, RequestEvent, ResultEvent
from schemas.reading import Line, Page
from services.common.dlq import oversized_result
from services.common.codec import dumps
from services.common.kafka import Outgoing
from services.common.records import RecordParser, Record
from services.common.runner import Handler, StageRunner
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
UPSTREAM = [("traceparent", f"00-{TRACE}-{PARENT}-01".encode()), ("origin", b"test")]


def consumed(topic: str, offset: int, value: bytes | None, headers=()) -> ConsumerRecord:
    return ConsumerRecord(topic=topic, partition=0, offset=offset, timestamp=1_000, timestamp_type=0, key=b"k\xff",
                          value=value, checksum=None, serialized_key_size=2, serialized_value_size=len(value or b""),
                          headers=list(headers))


class Seen(Handler):
    """Requests on ``t`` (bytes on any other topic); records every call and every poison."""

    def __init__(self):
        self.calls: list[list[tuple[int, object]]] = []
        self.poisoned: list[tuple[int, str, int]] = []

    def consumes(self):
        return {"t": RequestEvent}

    async def handle(self, records: list[Record]) -> list[Outgoing]:
        self.calls.append([(r.offset, r.value) for r in records])
        return [Outgoing("out", None, b"%d" % r.offset) for r in records]

    def poison(self, record, exc, attempts):
        self.poisoned.append((record.offset, type(exc).__name__, attempts))
        return [Outgoing("dlq", None, record.raw or b"")]


def runner_for(handler: Handler, telemetry: Telemetry | None = None) -> StageRunner:
    return StageRunner(stage="test", consumer=None, producer=None, handler=handler,  # type: ignore[arg-type]
                       telemetry=telemetry or Telemetry("test", TelemetrySettings()), max_attempts=3,
                       max_backoff_s=0.01)


def test_a_record_is_decoded_by_its_topic_and_keeps_what_it_was_consumed_as():
    req = RequestEvent(request_id="r1")
    rec = RecordParser({"t": RequestEvent})(consumed("t", 5, dumps(req), UPSTREAM))
    assert rec.value == req and rec.error is None and rec.raw == dumps(req) and rec.size_bytes == len(dumps(req))
    assert (rec.topic, rec.partition, rec.offset, rec.timestamp_ms) == ("t", 0, 5, 1_000)
    assert rec.key == "k\ufffd" and rec.raw_key == b"k\xff" and rec.headers == tuple(UPSTREAM)
    bad = RecordParser({"t": RequestEvent})(consumed("t", 6, b"not json"))
    assert bad.value is None and isinstance(bad.error, orjson.JSONDecodeError) and bad.raw == b"not json"
    none = RecordParser({"t": RequestEvent})(consumed("t", 7, None))
    assert none.value is None and str(none.error) == "record has no value"
    raw = RecordParser({"t": RequestEvent})(consumed("other", 8, b"\x00bytes"))
    assert raw.value == b"\x00bytes" and raw.error is None  # a topic without a model: its bytes


def test_an_undecodable_record_fails_like_one_its_handler_raised_on():
    """Default ``undecodable``: the batch fails, its records are tried alone, the undecodable one
    ``max_attempts`` times, then goes to ``poison`` with its parse error (``internal_error``)."""
    handler = Seen()
    telemetry = Telemetry("test", TelemetrySettings())
    runner = runner_for(handler, telemetry)
    good = RequestEvent(request_id="r1")
    records = [runner._decode(consumed("t", 0, dumps(good))), runner._decode(consumed("t", 1, b"{")),
               runner._decode(consumed("u", 2, b"raw"))]
    out = asyncio.run(runner._process(records))
    assert handler.calls == [[(0, good)], [(2, b"raw")]]  # never the undecodable one
    assert handler.poisoned == [(1, "JSONDecodeError", 3)]
    assert [(m.topic, m.value) for m in out] == [("out", b"0"), ("dlq", b"{"), ("out", b"2")]
    assert telemetry.errors.labels("test", "internal_error")._value.get() == 1


class RefusesAtOnce(Seen):
    async def undecodable(self, record, exc):
        return [Outgoing("dlq", None, f"{record.offset}: {type(exc).__name__}".encode())]


def test_a_handler_may_refuse_an_undecodable_record_at_once():
    handler = RefusesAtOnce()
    runner = runner_for(handler)
    records = [runner._decode(consumed("t", 0, dumps(RequestEvent(request_id="r1")))),
               runner._decode(consumed("t", 1, dumps(RequestEvent(request_id="r1"))[:-1]))]
    out = asyncio.run(runner._process(records))
    assert [[o for o, _ in call] for call in handler.calls] == [[0]] and handler.poisoned == []
    assert [(m.topic, m.value) for m in out] == [("dlq", b"1: JSONDecodeError"), ("out", b"0")]


class Traces(Seen):
    """Record 0's work inside its span, record 1's span used and left open, record 2 untouched."""

    async def handle(self, records):
        self.headers = []
        with records[0].traced():
            self.headers.append(records[0].trace_headers())
            self.current = records[0].traceparent()
        records[1].span.set_attribute("ocrstream.left_open", True)
        self.headers.append(records[1].trace_headers())
        return []


def test_each_record_gets_a_consumer_span_of_its_trace_and_the_runner_ends_those_left_open(tmp_path):
    path = tmp_path / "spans.jsonl"
    telemetry = Telemetry("test", TelemetrySettings(traces_exporter="file", traces_file=str(path)))
    handler = Traces()
    runner = runner_for(handler, telemetry)
    records = [runner._decode(consumed("t", i, dumps(RequestEvent(request_id=f"r{i}")), UPSTREAM)) for i in range(3)]
    asyncio.run(runner._process(records))
    telemetry.close()  # flushes
    spans = sorted((orjson.loads(line) for line in path.read_bytes().splitlines()),
                   key=lambda s: s["attributes"]["messaging.kafka.offset"])
    assert [s["attributes"]["messaging.kafka.offset"] for s in spans] == [0, 1]  # record 2's never started
    for s in spans:
        assert (s["name"], s["kind"], s["trace_id"], s["parent_span_id"]) == ("test", "CONSUMER", TRACE, PARENT)
        assert s["attributes"]["messaging.source.name"] == "t" and s["end_ns"] >= s["start_ns"]
    assert spans[1]["attributes"]["ocrstream.left_open"] is True
    for s, headers in zip(spans, handler.headers):
        assert ("origin", b"test") in headers  # the record's other headers travel on
        assert dict(headers)["traceparent"].decode() == f"00-{TRACE}-{s['span_id']}-01"
    assert handler.current == f"00-{TRACE}-{spans[0]['span_id']}-01"


class Producer:
    """Acknowledges every send at once, keeping what was sent."""

    def __init__(self):
        self.sent: list[tuple[str, bytes, bytes | None]] = []

    async def send(self, topic, value, key=None, headers=None):
        self.sent.append((topic, value, key))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


class EndsResults(Seen):
    def oversize(self, msg, exc, stub):
        return [stub, *oversized_result(msg, exc)]


def big_result() -> bytes:
    line = Line(text="X" * 50, box=[[0, 0], [10, 0], [10, 10], [0, 10]], confidence=0.9)
    return dumps(ResultEvent(request=RequestEvent(request_id="req-1", content_sha256="c" * 64), cache_key="g:" + "c" * 64,
                             status="ok", pages=[Page(index=1, width=10, height=10)], lines=[line] * 100))


def produce(handler: Handler, messages: list[Outgoing]) -> list[tuple[str, bytes, bytes | None]]:
    producer = Producer()
    runner = StageRunner(stage="test", consumer=None, producer=producer, handler=handler,  # type: ignore[arg-type]
                         telemetry=Telemetry("test", TelemetrySettings()), dlq_topic="dlq",
                         size_limits={"results": 4096, "dlq": 4096})
    asyncio.run(runner._produce(messages))
    return producer.sent


def test_a_message_over_its_topics_limit_is_what_the_handlers_oversize_hook_says():
    msgs = [Outgoing("results", "c" * 64, big_result()), Outgoing("results", "k2", b"small")]
    [stub, small] = produce(Seen(), msgs)  # default: the DLQ stub alone
    ev = DlqEvent.model_validate_json(stub[1])
    assert stub[0] == "dlq" and stub[2] == b"c" * 64 and small == ("results", b"small", b"k2")
    assert ev.request_id == "req-1" and ev.error_code is ErrorCode.INPUT_TOO_LARGE and ev.topic == "results"
    [stub2, failed, _] = produce(EndsResults(), msgs)  # a stage whose results end requests ends this one
    res = ResultEvent.model_validate_json(failed[1])
    assert stub2[0] == "dlq" and failed[0] == "results" and failed[2] == b"c" * 64
    assert res.status == "error" and res.error.code is ErrorCode.INPUT_TOO_LARGE and res.lines == []
    assert res.request.request_id == "req-1"
    assert oversized_result(Outgoing("results", None, b"not an event"), RuntimeError()) == []
