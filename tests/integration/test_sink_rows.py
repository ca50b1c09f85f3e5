"""Permanent database errors are not outages, against a real sink process.

* Rows are bounded by design: a result whose document is far over the row bound
  (``OCRSTREAM_MYSQL__ROW_MAX_BYTES``, 1 MiB) ends with one row and one completion holding its
  summary (lines left out, text cut), the whole output in S3 at ``result_uri``.
* With the bound set above MariaDB's ``max_allowed_packet`` (16 MiB), the same kind of result
  makes MariaDB refuse the packet and drop the connection (``OperationalError`` 1153, or 2006
  "gone away" when the drop wins: retriable by their type) while MariaDB answers pings: after the attempts the record goes to the DLQ and its
  request ends with ``internal_error``; it is never retried as an outage.

Each test runs one sink process in a namespace of its own; the results are produced straight
onto its ``ocr.results`` (the rest of the pipeline plays no part in a row's size).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import uuid

from aiokafka import TopicPartition

from schemas.errors import ErrorCode
from schemas.events import CompletedEvent, DlqEvent, OcrOutput, RequestEvent, ResultEvent
from schemas.keys import request_output_key
from schemas.reading import Line, Page
from services.common.codec import dumps
from services.common.kafka import make_consumer, make_producer
from services.common.s3 import ObjectStore
from services.common.settings import CommonSettings
from tests.stack import REPO, TEST_ENV, Pipeline, db_rows, env_applied, metric_value, namespace_env

ROW_MAX = 1_048_576


@contextlib.contextmanager
def sink_only(logdir, extra: dict[str, str]):
    """One sink process in a fresh namespace (topics, bucket, schema made by ``ocrstream init``)."""
    env = {**namespace_env(partitions=1), **TEST_ENV, "OCRSTREAM_RETRY_MAX_BACKOFF_S": "1", **extra}
    with env_applied(env):
        subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=REPO, check=True, capture_output=True)
        p = Pipeline(env=env, logdir=logdir)
        try:
            p.start("sink")
            yield p
        finally:
            p.stop_all()


def _result(rid: str, lines: list[str], cacheable: bool = True) -> ResultEvent:
    sha = uuid.uuid4().hex * 2
    box = [[0.0, 0.0], [10.0, 0.0], [10.0, 10.0], [0.0, 10.0]]
    return ResultEvent(request=RequestEvent(request_id=rid, content_sha256=sha), cache_key=f"{'a1' * 6}:{sha}",
                       status="ok", engine="rapidocr", model="m", model_revision="r", cacheable=cacheable,
                       pages=[Page(index=1, width=10, height=10)],
                       lines=[Line(text=t, box=box, confidence=0.9) for t in lines])


async def _produce(s: CommonSettings, events: list[ResultEvent]) -> None:
    producer = make_producer(s.kafka, "test-sink-rows")
    await producer.start()
    try:
        for ev in events:
            await producer.send_and_wait(s.topics.results, dumps(ev), key=ev.request.request_id.encode())
    finally:
        await producer.stop()


async def _read(s: CommonSettings, topic: str, want: int, bound_s: float = 120) -> list[bytes]:
    """Values on ``topic`` from its beginning, once ``want`` are there (or ``bound_s`` passed)."""
    consumer = make_consumer(s.kafka, [], None, "test-sink-rows-read")
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        out: list[bytes] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound_s
        while len(out) < want and loop.time() < deadline:
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                out += [r.value for r in recs]
        return out
    finally:
        await consumer.stop()


async def _lag(s: CommonSettings, group: str, topic: str, bound_s: float = 60) -> int:
    """The group's lag on ``topic`` once it reaches 0 (or at ``bound_s``)."""
    consumer = make_consumer(s.kafka, [], group, "test-sink-rows-lag")
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        lag = -1
        for _ in range(int(bound_s / 0.5)):
            lag = (await consumer.end_offsets([tp]))[tp] - ((await consumer.committed(tp)) or 0)
            if lag == 0:
                break
            await asyncio.sleep(0.5)
        return lag
    finally:
        await consumer.stop()


async def test_a_result_over_the_row_bound_keeps_its_summary_in_the_row_and_its_whole_in_s3(tmp_path):
    with sink_only(tmp_path, {}) as p:
        s = CommonSettings()
        ns = p.env["OCRSTREAM_REDIS__KEY_PREFIX"]
        # 30,000 lines, ~3.5 MB of text (quotes escape to 2 bytes of JSON, é and 字 are 2 and 3 of UTF-8)
        texts = [f'line {i:05d} "quoted" é字 ' + "x" * 90 for i in range(30_000)]
        big, odd, after = (f"{ns}-{k}" for k in ("big", "uncacheable", "after"))
        events = [_result(big, texts), _result(odd, texts, cacheable=False), _result(after, ["SMALL AFTER"])]
        assert len(dumps(events[0])) < 8 << 20  # fits its topic: the row is what is over a bound
        await _produce(s, events)
        done = {CompletedEvent.model_validate_json(v).request_id: CompletedEvent.model_validate_json(v)
                for v in await _read(s, s.topics.completed, 3)}
        assert set(done) == {big, odd, after}
        full = "\n".join(texts)
        store = ObjectStore(s.s3)
        for rid, ev in ((big, events[0]), (odd, events[1])):
            doc = done[rid].result
            assert doc.status == "ok" and doc.lines == [] and doc.lines_omitted == 30_000
            assert doc.text_truncated and full.startswith(doc.text) and 0.95 * ROW_MAX < len(doc.text.encode()) < ROW_MAX
            expected_key = (f"results/{ev.request.content_sha256}/{'a1' * 6}.json" if rid == big
                            else request_output_key(odd))
            assert doc.result_uri == store.uri(expected_key)
            whole = OcrOutput.model_validate_json(await store.get(expected_key))
            assert [ln.text for ln in whole.lines] == texts and whole.text == full
            [row] = db_rows("SELECT status, line_count, document_truncated, LENGTH(document_json) AS n, result_uri "
                            "FROM requests WHERE request_id = %s", rid)
            assert row["status"] == "ok" and row["line_count"] == 30_000 and row["document_truncated"] == 1
            assert row["n"] <= ROW_MAX and row["result_uri"] == doc.result_uri
        [res] = db_rows("SELECT text, text_truncated, line_count FROM results WHERE cache_key = %s", events[0].cache_key)
        assert res["text_truncated"] == 1 and res["line_count"] == 30_000
        assert full.startswith(res["text"]) and ROW_MAX - 4 < len(res["text"].encode()) <= ROW_MAX
        assert db_rows("SELECT cache_key FROM results WHERE cache_key = %s", events[1].cache_key) == []
        assert done[after].result.status == "ok" and done[after].result.text == "SMALL AFTER"
        assert not done[after].result.lines_omitted and not done[after].result.text_truncated
        # exactly one completion each, one row each, nothing in the DLQ, nothing left to consume
        assert len(await _read(s, s.topics.completed, 4, bound_s=3)) == 3
        assert len(db_rows("SELECT request_id FROM requests WHERE request_id IN (%s, %s, %s)", big, odd, after)) == 3
        assert await _read(s, s.topics.dlq, 1, bound_s=2) == []
        assert await _lag(s, p.env["OCRSTREAM_SINK_GROUP_ID"], s.topics.results) == 0


async def test_a_row_the_database_refuses_while_it_answers_goes_to_the_dlq_after_the_attempts(tmp_path):
    # a bound above the server's max_allowed_packet (16 MiB): the row is sent, and refused
    with sink_only(tmp_path, {"OCRSTREAM_MYSQL__ROW_MAX_BYTES": str(64 << 20)}) as p:
        s = CommonSettings()
        ns = p.env["OCRSTREAM_REDIS__KEY_PREFIX"]
        refused, after = f"{ns}-refused", f"{ns}-after"
        # one line of 3.5 M quotes: 7 MB of JSON on Kafka; the requests row holds it twice (lines
        # and text), and SQL escaping doubles that: a 28 MB packet
        events = [_result(refused, ['"' * 3_500_000]), _result(after, ["NEXT ONE THROUGH"])]
        assert len(dumps(events[0])) < 8 << 20
        await _produce(s, events)
        done = {CompletedEvent.model_validate_json(v).request_id: CompletedEvent.model_validate_json(v)
                for v in await _read(s, s.topics.completed, 2)}
        assert set(done) == {refused, after}
        err = done[refused].result
        assert err.status == "error" and err.error.code is ErrorCode.INTERNAL_ERROR
        # MariaDB refuses the packet (1153) and drops the connection: the client sees the refusal or,
        # when the drop wins the race, "server has gone away" / "lost connection" (2006, 2013)
        assert re.match(r"sink: \((1153|2006|2013), ", err.error.message), err.error.message
        [raw] = await _read(s, s.topics.dlq, 1)
        dlq = DlqEvent.model_validate_json(raw)
        assert dlq.stage == "sink" and dlq.request_id == refused and dlq.attempts == s.max_attempts
        assert dlq.error_code is ErrorCode.INTERNAL_ERROR and "OperationalError" in dlq.reason
        assert dlq.topic == s.topics.results and dlq.value_b64  # the original bytes (cut to 512 KiB)
        [row] = db_rows("SELECT status, error_code FROM requests WHERE request_id = %s", refused)
        assert row == {"status": "error", "error_code": "internal_error"}
        assert done[after].result.status == "ok" and done[after].result.text == "NEXT ONE THROUGH"
        # counted as the record's failures, never as an outage (no backoff "dependency down")
        metrics = p.metrics("sink")
        assert metric_value(metrics, "ocrstream_dependency_retries_total", stage="sink") == 0
        assert "although every dependency answers" in p.stages["sink"][0].log.read_text()
        assert await _lag(s, p.env["OCRSTREAM_SINK_GROUP_ID"], s.topics.results) == 0
