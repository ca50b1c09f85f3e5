"""Building ``ocr.dlq`` events and error results for messages a stage gives up on."""

from __future__ import annotations

import base64

import orjson
from aiokafka import ConsumerRecord

from schemas.errors import ErrorCode
from schemas.events import DlqEvent, ErrorInfo, RequestEvent, ResultEvent
from schemas.ids import is_request_id
from services.common.errors import OcrError
from services.common.events import dumps
from services.common.kafka import Outgoing
from schemas.topics import Topics


DLQ_VALUE_MAX_BYTES = 512 * 1024
"""Original values larger than this are cut in the DLQ event (base64 grows them by a third)."""


def _b64(raw: bytes | None) -> str | None:
    return base64.b64encode(raw[:DLQ_VALUE_MAX_BYTES]).decode() if raw is not None else None


def request_id_of(record: ConsumerRecord) -> str | None:
    """Best-effort request id from a record's value (any of our event shapes), else None.

    Only an id that follows the request id rule (:mod:`schemas.ids`) counts: a longer one is
    never cut to 64 characters, which could name another request."""
    try:
        value = orjson.loads(record.value)
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
