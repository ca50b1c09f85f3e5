"""Building ``ocr.dlq`` events and error results for records a stage gives up on, and what
replaces a message too large for its topic (the stub, and the error result of an ``ok`` result)."""

from __future__ import annotations

import base64

import orjson
from pydantic import ValidationError

from schemas.errors import ErrorCode
from schemas.events import DlqEvent, RequestEvent, ResultEvent
from schemas.ids import is_request_id
from schemas.reading import ErrorInfo
from services.common.errors import OcrError
from services.common.codec import dumps
from services.common.kafka import Outgoing
from services.common.records import Record
from schemas.topics import Topics


DLQ_VALUE_MAX_BYTES = 512 * 1024
"""Original values larger than this are cut in the DLQ event (base64 grows them by a third)."""


def _b64(raw: bytes | None) -> str | None:
    return base64.b64encode(raw[:DLQ_VALUE_MAX_BYTES]).decode() if raw is not None else None


def request_id_of(record: Record) -> str | None:
    """Best-effort request id from a record's value (any of our event shapes), else None.

    Only an id that follows the request id rule (:mod:`schemas.ids`) counts: a longer one is
    never cut to 64 characters, which could name another request."""
    try:
        value = orjson.loads(record.raw)
    except Exception:
        return None
    if not isinstance(value, dict):
        return None
    for holder in (value, value.get("request") or {}):
        rid = holder.get("request_id") if isinstance(holder, dict) else None
        if is_request_id(rid):
            return rid
    return None


def poison_messages(
    *, stage: str, topics: Topics, record: Record, exc: BaseException, attempts: int,
    request: RequestEvent | None = None, cache_key: str | None = None,
) -> list[Outgoing]:
    """The DLQ event for ``record`` plus, when it names a request, an error result for it.

    Args:
        stage: The stage giving up.
        topics: Topic names.
        record: The original record (its bytes, key and headers are preserved in the DLQ event).
        exc: The last error.
        attempts: How many times processing was tried.
        request: The request the record belongs to, if known (ingest: the submission's, under
            its chosen or derived id); else the id is read from the record's value.
        cache_key: The request's cache key, so the sink also settles the requests waiting on it.
    """
    code = exc.code if isinstance(exc, OcrError) else ErrorCode.INTERNAL_ERROR
    # never the record's key: a key is not a request id (a junk record keyed by another request's
    # id would end that request); ingest passes the submission's own request or its derived one
    rid = request.request_id if request else request_id_of(record)
    dlq = DlqEvent(
        stage=stage,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key_b64=_b64(record.raw_key),
        value_b64=_b64(record.raw),
        headers={k: base64.b64encode(v).decode() for k, v in (record.headers or [])},
        reason=(f"{type(exc).__name__}: {exc}"[:2000]
                + (f" (value cut to {DLQ_VALUE_MAX_BYTES} bytes)" if record.size_bytes > DLQ_VALUE_MAX_BYTES else "")),
        error_code=code,
        attempts=attempts,
        request_id=rid,
    )
    out = [Outgoing(topics.dlq, rid or f"{record.topic}-{record.partition}-{record.offset}", dumps(dlq), list(record.headers or []))]
    if rid:
        req = request or RequestEvent(request_id=rid)
        result = ResultEvent(
            request=req,
            cache_key=cache_key,
            status="error",
            error=ErrorInfo(code=code, message=f"{stage}: {exc}"[:1000]),
            attempt=attempts,
        )
        out.append(Outgoing(topics.results, rid, dumps(result), list(record.headers or [])))
    return out


def key_bytes(msg: Outgoing) -> bytes | None:
    """``msg``'s key as bytes (a str key UTF-8 encoded), or None."""
    return msg.key.encode() if isinstance(msg.key, str) else msg.key


RECORD_OVERHEAD_BYTES = 512
"""Bytes added to a message's key, value and headers for the record batch around it when it is
compared with its topic's ``max.message.bytes`` (a v2 batch header is 61 bytes, a record's own
framing under 30: the rest is margin)."""


def record_bytes(msg: Outgoing, key: bytes | None) -> int:
    """What ``msg`` costs against its topic's ``max.message.bytes`` (bytes, with margin)."""
    headers = sum(len(k) + len(v) for k, v in (msg.headers or []))
    return len(msg.value) + len(key or b"") + headers + RECORD_OVERHEAD_BYTES


def oversized_stub(stage: str, dlq_topic: str, msg: Outgoing, exc: BaseException) -> Outgoing:
    """The small DLQ event produced instead of ``msg``, too large for its topic: it names the
    message's request (its value's ``request_id`` or ``request.request_id``, else its key when that
    is a request id) and the error, with ``input_too_large``."""
    key = key_bytes(msg)
    try:
        value = orjson.loads(msg.value)
    except orjson.JSONDecodeError:
        value = None
    rid = None
    if isinstance(value, dict):
        inner = value.get("request") if isinstance(value.get("request"), dict) else {}
        rid = value.get("request_id") or inner.get("request_id")
    if not isinstance(rid, str) or not rid:
        rid = key.decode(errors="replace") if key else None
    stub = DlqEvent(stage=stage, topic=msg.topic, partition=-1, offset=-1, reason=f"message too large: {exc}"[:2000],
                    error_code=ErrorCode.INPUT_TOO_LARGE, request_id=rid if is_request_id(rid) else None)
    return Outgoing(dlq_topic, key, dumps(stub), [])


def oversized_result(msg: Outgoing, exc: BaseException) -> list[Outgoing]:
    """For ``msg`` an ``ok`` :class:`~schemas.events.ResultEvent` too large for its topic: the same
    result as an ``input_too_large`` error without its lines and pages (same topic, key and
    headers), so the request (and the copies waiting on its image, which would read the same)
    still gets a final state. Empty for any other message (another event, an error result)."""
    try:
        ev = ResultEvent.model_validate_json(msg.value)
    except ValidationError:
        return []
    if ev.status != "ok":
        return []
    failed = ev.model_copy(update={"status": "error", "lines": [], "pages": [], "error": ErrorInfo(
        code=ErrorCode.INPUT_TOO_LARGE,
        message=f"the OCR result ({len(msg.value)} bytes) is over the Kafka message limit: {exc}"[:1000])})
    return [Outgoing(msg.topic, msg.key, dumps(failed), list(msg.headers or []))]
