"""Building ``ocr.dlq`` events and error results for messages a stage gives up on."""

from __future__ import annotations

import base64
import re

import orjson
from aiokafka import ConsumerRecord

from schemas.errors import ErrorCode
from schemas.events import DlqEvent, ErrorInfo, RequestEvent, ResultEvent
from services.common.errors import OcrError
from services.common.events import dumps
from services.common.kafka import Outgoing
from schemas.topics import Topics


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

DLQ_VALUE_MAX_BYTES = 512 * 1024
"""Original values larger than this are cut in the DLQ event (base64 grows them by a third)."""


def _b64(raw: bytes | None) -> str | None:
    return base64.b64encode(raw[:DLQ_VALUE_MAX_BYTES]).decode() if raw is not None else None


def request_id_of(record: ConsumerRecord) -> str | None:
    """Best-effort request id from a record's value (any of our event shapes), else None."""
    try:
        value = orjson.loads(record.value)
    except Exception:
        return None
    if not isinstance(value, dict):
        return None
    for holder in (value, value.get("request") or {}):
        rid = holder.get("request_id") if isinstance(holder, dict) else None
        if isinstance(rid, str) and rid:
            return rid[:64]
    return None


def poison_messages(
    *, stage: str, topics: Topics, record: ConsumerRecord, exc: BaseException, attempts: int,
    request: RequestEvent | None = None, cache_key: str | None = None,
) -> list[Outgoing]:
    """The DLQ event for ``record`` plus, when it names a request, an error result for it.

    Args:
        stage: The stage giving up.
        topics: Topic names.
        record: The original record (its bytes and headers are preserved in the DLQ event).
        exc: The last error.
        attempts: How many times processing was tried.
        request: The parsed request, if the record could be parsed that far.
        cache_key: The request's cache key, so the sink also settles the requests waiting on it.
    """
    code = exc.code if isinstance(exc, OcrError) else ErrorCode.INTERNAL_ERROR
    rid = request.request_id if request else request_id_of(record)
    if rid is None and record.topic == topics.submit and record.key:
        key = record.key.decode(errors="replace")
        rid = key if _REQUEST_ID.fullmatch(key) else None  # upstream keys submissions by request id
    dlq = DlqEvent(
        stage=stage,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key_b64=_b64(record.key),
        value_b64=_b64(record.value),
        headers={k: base64.b64encode(v).decode() for k, v in (record.headers or [])},
        reason=(f"{type(exc).__name__}: {exc}"[:2000]
                + (f" (value cut to {DLQ_VALUE_MAX_BYTES} bytes)" if record.value and len(record.value) > DLQ_VALUE_MAX_BYTES else "")),
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
