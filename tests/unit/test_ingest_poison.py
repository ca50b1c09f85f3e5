"""Ingest's poison path (pure logic: no Kafka, no S3): the request a submission started ends with the
error, under the same id its other outcomes would have used."""

from __future__ import annotations

import orjson
from aiokafka import ConsumerRecord

from schemas.errors import ErrorCode
from schemas.events import SubmitEvent
from services.common.errors import OcrError
from services.common.codec import derived_request_id, dumps
from services.common.records import RecordParser
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from services.ingest.handler import IngestHandler
from services.ingest.settings import IngestSettings

S = IngestSettings()


def poisoned(value: bytes, key: bytes | None) -> list:
    h = IngestHandler(S, None, Telemetry("ingest", TelemetrySettings()), None)  # type: ignore[arg-type]
    record = RecordParser(h.consumes())(ConsumerRecord(S.topics.submit, 2, 417, 0, 0, key, value, None, len(key or b""),
                                                  len(value), []))
    return h.poison(record, OcrError(ErrorCode.MISSING_OBJECT, "s3://b/gone.png: no such key"), attempts=3)


def test_a_submission_without_an_id_fails_under_its_derived_id_with_its_callback():
    """Not under its Kafka key (upstream keys are not request ids here), and with its callback URL,
    so the caller's webhook reports the failure."""
    ev = SubmitEvent(image_uri="s3://b/gone.png", callback_url="https://hooks.example.com/ocr", source="scans")
    dlq, result = poisoned(dumps(ev), key=b"upstream-key-7")
    rid = derived_request_id(S.topics.submit, 2, 417)
    body = orjson.loads(result.value)
    assert result.topic == S.topics.results and result.key == rid
    assert body["request"]["request_id"] == rid and body["request"]["callback_url"] == "https://hooks.example.com/ocr"
    assert body["request"]["source"] == "scans" and body["error"]["code"] == "missing_object"
    assert dlq.topic == S.topics.dlq and orjson.loads(dlq.value)["request_id"] == rid


def test_a_submission_with_an_id_fails_under_it_and_an_unreadable_one_under_its_derived_id():
    """Never under the record's key: a junk record keyed by another request's id must not end that request."""
    ev = SubmitEvent(request_id="order-55", image_uri="s3://b/gone.png")
    _, result = poisoned(dumps(ev), key=b"order-55")
    assert result.key == "order-55" and orjson.loads(result.value)["request"]["request_id"] == "order-55"
    rid = derived_request_id(S.topics.submit, 2, 417)
    for value in (b"{not json", b'{"request_id": "order-56\\ud800", "image_b64": "AA=="}',
                  orjson.dumps({"request_id": "x" * 65, "image_b64": "AA=="})):
        dlq, result = poisoned(value, key=b"order-56")
        assert result.key == rid and orjson.loads(dlq.value)["request_id"] == rid
        assert orjson.loads(result.value)["request"]["request_id"] == rid
