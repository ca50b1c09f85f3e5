"""Ingest logic: submit event -> checked image in S3 -> ``ocr.requests`` (or an error result)."""

from __future__ import annotations

import asyncio
import binascii
import logging
import time

from aiokafka import ConsumerRecord
from pydantic import ValidationError

from schemas.errors import ErrorCode
from schemas.events import ErrorInfo, RequestEvent, ResultEvent, SubmitEvent, now_ms
from services.common.decoding import DecoderPool
from services.common.dlq import poison_messages
from services.common.errors import OcrError
from services.common.events import derived_request_id, dumps, loads, queue_wait_ms
from services.common.kafka import Outgoing
from services.common.runner import Handler
from services.common.s3 import ObjectStore
from services.common.telemetry import SpanKind, Telemetry, record_attrs as _record_attrs
from services.ingest.accept import accept_image
from services.ingest.settings import IngestSettings

log = logging.getLogger(__name__)

class IngestHandler(Handler):
    """Checks each submission and stores its image by content hash.

    Per record: parse ``SubmitEvent`` -> bytes (inline or from S3, byte limit enforced) ->
    sniff format and header size (no decode) -> SHA-256 -> put ``images/<sha[:2]>/<sha>``
    unless present -> ``RequestEvent`` on ``ocr.requests`` keyed by the hash. Bad input yields
    an error ``ResultEvent`` on ``ocr.results`` (so the request still gets a final state); an
    unparseable record goes to ``ocr.dlq``.
    """

    def __init__(self, settings: IngestSettings, store: ObjectStore, telemetry: Telemetry,
                 decoder: DecoderPool | None = None):
        self.s = settings
        self.store = store
        self.telemetry = telemetry
        self.decoder = decoder or DecoderPool(settings.decode, settings.limits)  # the format checks, bounded
        self._sem = asyncio.Semaphore(settings.ingest_concurrency)

    async def handle(self, records: list[ConsumerRecord]) -> list[Outgoing]:
        """See :meth:`Handler.handle`; records are processed concurrently, output kept in order."""
        results = await asyncio.gather(*(self._one(r) for r in records))
        return [msg for msgs in results for msg in msgs]

    async def _one(self, record: ConsumerRecord) -> list[Outgoing]:
        async with self._sem:
            # continues the submitter's trace, or starts the request's trace when it sent none
            with self.telemetry.span("ingest", parent_headers=record.headers, kind=SpanKind.CONSUMER,
                                     attributes=_record_attrs(record)):
                return await self._traced_one(record)

    async def _traced_one(self, record: ConsumerRecord) -> list[Outgoing]:
        queued = queue_wait_ms(record)
        started = time.perf_counter()
        headers = self.telemetry.inject(record.headers)
        try:
            event = loads(SubmitEvent, record.value)
        except (ValueError, ValidationError) as exc:
            # Not retried: the same bytes fail the same way. DLQ + error result if we know the id.
            self.telemetry.requests_done.labels("ingest", "error", ErrorCode.INVALID_REQUEST.value).inc()
            return poison_messages(
                stage="ingest", topics=self.s.topics, record=record,
                exc=OcrError(ErrorCode.INVALID_REQUEST, f"submit event rejected: {exc}"[:1000]), attempts=1,
            )
        base = _request_of(event, record).model_copy(update={"traceparent": self.telemetry.traceparent()})
        rid = base.request_id
        try:
            req = await self._accept(event, base)
        except OcrError as err:
            if err.code == ErrorCode.MISSING_OBJECT:
                raise  # retried a bounded number of times, then DLQ + error result (Handler.poison)
            timings = {"queue_ingest": queued, "ingest": (time.perf_counter() - started) * 1000}
            failed = base.model_copy(update={"timings_ms": timings})
            result = ResultEvent(request=failed, status="error", error=ErrorInfo(code=err.code, message=err.message))
            self.telemetry.requests_done.labels("ingest", "error", err.code.value).inc()
            log.info("ingest: request %s rejected: %s", rid, err)
            return [Outgoing(self.s.topics.results, rid, dumps(result), headers)]
        timings = {"queue_ingest": queued, "ingest": (time.perf_counter() - started) * 1000}
        req = req.model_copy(update={"timings_ms": timings, "accepted_at_ms": now_ms()})
        log.info("ingest: %s[%d]@%d request %s accepted (%s, %d bytes)", record.topic, record.partition,
                 record.offset, rid, req.format, req.size_bytes)
        return [Outgoing(self.s.topics.requests, req.content_sha256, dumps(req), headers)]

    async def _accept(self, event: SubmitEvent, base: RequestEvent) -> RequestEvent:
        if (refused := self.s.task_error(event.task)) is not None:
            raise OcrError(ErrorCode.INVALID_REQUEST, refused)
        limits = self.s.limits
        if event.image_b64 is not None:
            try:
                data = event.image_bytes()
            except (ValueError, binascii.Error) as exc:
                raise OcrError(ErrorCode.INVALID_REQUEST, f"image_b64 is not valid base64: {exc}") from exc
        else:
            data = await self.store.get_uri(event.image_uri, max_bytes=limits.max_image_bytes)
        acc = await accept_image(data, limits, self.store, self.decoder)
        return base.model_copy(
            update={
                "content_sha256": acc.content_sha256, "image_uri": acc.image_uri, "size_bytes": acc.size_bytes,
                "format": acc.info.format, "width": acc.info.width, "height": acc.info.height,
                "frames": acc.info.frames,
            }
        )

    async def close(self) -> None:
        """Stop the decoder processes."""
        await self.decoder.close()

    def poison(self, record: ConsumerRecord, exc: BaseException, attempts: int) -> list[Outgoing]:
        """DLQ the submission and fail its request: the id it named, or for a submission without one
        the id derived from its offset (the one its other outcomes use), with its callback URL
        and options, so its webhook fires too."""
        try:
            request = _request_of(loads(SubmitEvent, record.value), record)
        except (ValueError, ValidationError):
            request = None
        return poison_messages(stage="ingest", topics=self.s.topics, record=record, exc=exc, attempts=attempts,
                               request=request)


def _request_of(event: SubmitEvent, record: ConsumerRecord) -> RequestEvent:
    """The request a submission starts: its own id, or one derived from the record's offset."""
    rid = event.request_id or derived_request_id(record.topic, record.partition, record.offset)
    return RequestEvent(request_id=rid, task=event.task, source=event.source, filename=event.filename,
                        callback_url=event.callback_url, submitted_at_ms=event.submitted_at_ms,
                        metadata=event.metadata)
