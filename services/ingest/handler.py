"""Ingest logic: submit event -> checked image in S3 -> ``ocr.requests`` (or an error result)."""

from __future__ import annotations

import asyncio
import binascii
import logging
import time

import orjson
from pydantic import ValidationError

from schemas.errors import ErrorCode
from schemas.events import RequestEvent, ResultEvent, SubmitEvent, now_ms
from schemas.ids import chosen_request_id_problem, is_request_id
from schemas.lanes import request_priority
from schemas.reading import ErrorInfo
from schemas.tasks import TaskError
from services.common.requests import claims
from services.common.documents import state as documents
from services.common.requests.claims import RequestClaim
from services.common.db import Database
from services.common.images.decoding import DecoderPool
from services.common.dlq import poison_messages
from services.common.errors import OcrError
from services.common.codec import derived_request_id, dumps
from services.common.handler import Handler, Outgoing, Record
from services.common.s3 import ObjectStore, reference_problem
from services.common.telemetry import Telemetry
from services.common.images.accept import accept_image
from services.ingest import door
from services.ingest.settings import IngestSettings
from services.common.documents.split import is_document, split_pages

log = logging.getLogger(__name__)

class IngestHandler(Handler):
    """Checks each submission and stores its image by content hash.

    Per record: parse ``SubmitEvent`` (its ``request_id`` by :mod:`schemas.ids`) -> bytes (inline
    or from S3 under an allowed prefix, byte limit enforced) -> sniff format and header size (no
    decode) -> SHA-256 -> put ``images/<sha[:2]>/<sha>`` unless present -> claim the chosen
    request id (:mod:`services.common.requests.claims`) -> ``RequestEvent`` on ``ocr.requests`` keyed by
    the hash. Bad input yields an error ``ResultEvent`` on ``ocr.results`` (so the request still
    gets a final state); a record that fails its schema also goes to ``ocr.dlq``.

    Which id a final state goes under: the chosen ``request_id`` when this submission holds it
    (a new claim, or a retry of the same record or the same content); else -- no id, an invalid
    one, one another request holds -- the id derived from the record's offset
    (:func:`~services.common.codec.derived_request_id`), the message naming the id it asked for.
    So a submission can never end, or take the result of, another request. A submission refused
    before its image was read claims its id without content (it has its final state under it).

    A document (a PDF or TIFF of more than one page; ``split_documents``) is checked against the
    document limits before any page is rendered, stored as it is, then split: each page rendered
    and stored under its own hash, the document registered in MariaDB, and one request per page
    on ``ocr.requests`` (:mod:`services.common.documents.split`, ``docs/documents.md``).

    A submission marked as the HTTP door's (``door: http`` or an ``api_key_id``: a document the
    door stored) is believed only when the door's claim of its id and the stored object's hash
    say the same (:mod:`services.ingest.door`); then it carries the API key and is not claimed
    again. Else it ends ``http_door_unverified`` under its derived id.
    """

    def __init__(self, settings: IngestSettings, store: ObjectStore, telemetry: Telemetry,
                 decoder: DecoderPool | None = None, db: Database | None = None):
        self.s = settings
        self.store = store
        self.telemetry = telemetry
        self.decoder = decoder or DecoderPool(settings.decode, settings.limits)  # the format checks, bounded
        self.db = db  # request id claims; None only where nothing is claimed (unit tests of the poison path)
        self.allowed = settings.allowed_prefixes()
        self._sem = asyncio.Semaphore(settings.ingest_concurrency)

    def consumes(self) -> dict[str, type[SubmitEvent]]:
        """``ocr.submit`` -> :class:`SubmitEvent` (see :meth:`Handler.consumes`)."""
        return {self.s.topics.submit: SubmitEvent}

    async def handle(self, records: list[Record[SubmitEvent]]) -> list[Outgoing]:
        """See :meth:`Handler.handle`; records are processed concurrently, output kept in order."""
        results = await asyncio.gather(*(self._one(r) for r in records))
        return [msg for msgs in results for msg in msgs]

    async def _one(self, record: Record[SubmitEvent]) -> list[Outgoing]:
        async with self._sem:
            # its span continues the submitter's trace, or starts the request's trace when it sent none
            with record.traced():
                return await self._traced_one(record)

    async def undecodable(self, record: Record, exc: Exception) -> list[Outgoing]:
        """A submission refused as it stands (not JSON, not an object, an invalid ``request_id``,
        another schema error; :func:`_parse` says why). Not retried: the same bytes fail the same
        way. Its DLQ event and an error result under an id it may use."""
        async with self._sem:
            _, base, chosen, problem = _parse(record)
            base = base.model_copy(update={"traceparent": record.traceparent()})
            base, note = await self._own_or_derived(base, chosen, record)
            self.telemetry.requests_done.labels("ingest", "error", ErrorCode.INVALID_REQUEST.value).inc()
            return poison_messages(
                stage="ingest", topics=self.s.topics, record=record, request=base,
                exc=OcrError(ErrorCode.INVALID_REQUEST, f"{note}submit event rejected: {problem or exc}"[:1000]),
                attempts=1,
            )

    async def _traced_one(self, record: Record[SubmitEvent]) -> list[Outgoing]:
        queued = record.queue_wait_ms()
        started = time.perf_counter()
        headers = record.trace_headers()
        event = record.value
        chosen = event.request_id
        base = _request_of(event, chosen or derived_request_id(record.topic, record.partition, record.offset), record)
        base = base.model_copy(update={"traceparent": record.traceparent()})
        rid = base.request_id

        def failed(request: RequestEvent, code: ErrorCode, message: str) -> list[Outgoing]:
            timings = {"queue_ingest": queued, "ingest": (time.perf_counter() - started) * 1000}
            result = ResultEvent(request=request.model_copy(update={"timings_ms": timings}), status="error",
                                 error=ErrorInfo(code=code, message=message[:1000]))
            self.telemetry.requests_done.labels("ingest", "error", code.value).inc()
            log.info("ingest: request %s rejected: %s: %s", request.request_id, code.value, message[:300])
            return [Outgoing(self.s.topics.results, request.request_id, dumps(result), headers)]

        held = None  # the HTTP door's claim of a submission it marked (services/ingest/door.py)
        if door.is_marked(event):
            try:
                held = await door.verify_claim(self.db, self.store, event)
            except OcrError as err:
                return failed(*_unverified(base, record, err))
            base = base.model_copy(update={"api_key_id": event.api_key_id})
        try:
            req, data = await self._accept(event, base, trusted=held is not None)
            if held is not None:
                door.check_content(held, req.content_sha256)
        except OcrError as err:
            if err.code == ErrorCode.HTTP_DOOR_UNVERIFIED:
                return failed(*_unverified(base, record, err))
            owned, note = (base, "") if held is not None else await self._own_or_derived(base, chosen, record)
            if err.code == ErrorCode.MISSING_OBJECT and not note:
                raise  # retried a bounded number of times, then DLQ + error result (Handler.poison)
            return failed(owned, err.code, note + err.message)
        if chosen is not None and held is None:  # a verified HTTP door submission holds the door's claim
            outcome = await claims.claim(self.db, RequestClaim(
                request_id=chosen, content_sha256=req.content_sha256, task=req.task, door="kafka",
                origin=_origin(record)))
            if outcome.kind == "conflict":
                derived = derived_request_id(record.topic, record.partition, record.offset)
                return failed(base.model_copy(update={"request_id": derived}), ErrorCode.REQUEST_ID_CONFLICT,
                              f"{outcome.reason}: this submission ends under its derived request id {derived}; "
                              "choose another request_id")
        if self.s.split_documents and is_document(req):
            try:
                return await self._split(record, req, data, queued, started)
            except OcrError as err:
                return failed(req, err.code, err.message)
        timings = {"queue_ingest": queued, "ingest": (time.perf_counter() - started) * 1000}
        req = req.model_copy(update={"timings_ms": timings, "accepted_at_ms": now_ms()})
        log.info("ingest: %s[%d]@%d request %s accepted (%s, %d bytes)", record.topic, record.partition,
                 record.offset, rid, req.format, req.size_bytes)
        return [Outgoing(self.s.topics.requests, req.content_sha256, dumps(req), headers)]

    async def _split(self, record: Record[SubmitEvent], doc: RequestEvent, data: bytes, queued: float,
                     started: float) -> list[Outgoing]:
        """A document: its pages rendered and stored (:func:`~services.common.documents.split.split_pages`),
        its row registered in MariaDB, then one request per page on ``ocr.requests``, each keyed
        by its page's hash; a page that could not be rendered gets its error result on
        ``ocr.results`` instead, keyed by its request id, so the sink records it like any failed
        page (docs/documents.md)."""
        doc = doc.model_copy(update={"document_id": doc.request_id, "page_count": doc.frames})
        pages = await split_pages(doc, data, self.decoder, self.store, self.s.split_batch_pages)
        timings = {"queue_ingest": queued, "ingest": (time.perf_counter() - started) * 1000}
        accepted = now_ms()
        doc = doc.model_copy(update={"timings_ms": timings, "accepted_at_ms": accepted})
        await documents.register(self.db, doc, len(pages), accepted)  # before any page can complete
        failed = [p for p in pages if p.error is not None]
        log.info("ingest: %s[%d]@%d document %s accepted (%s, %d bytes, %d pages, %d not rendered)", record.topic,
                 record.partition, record.offset, doc.request_id, doc.format, doc.size_bytes, len(pages), len(failed))
        headers = record.trace_headers()
        out = []
        for page, err in pages:
            page = page.model_copy(update={"timings_ms": timings, "accepted_at_ms": accepted})
            if err is None:
                out.append(Outgoing(self.s.topics.requests, page.content_sha256, dumps(page), headers))
                continue
            self.telemetry.requests_done.labels("ingest", "error", err.code.value).inc()
            log.info("ingest: page %s not rendered: %s: %s", page.request_id, err.code.value, err.message[:300])
            result = ResultEvent(request=page, status="error", error=ErrorInfo(code=err.code, message=err.message[:1000]))
            out.append(Outgoing(self.s.topics.results, page.request_id, dumps(result), headers))
        return out

    async def _own_or_derived(self, base: RequestEvent, chosen: str | None,
                              record: Record) -> tuple[RequestEvent, str]:
        """For a submission refused before its image was read: ``base`` when it may end under its
        chosen id (it claims the id without content, or already held it: a redelivery), else
        ``base`` under its derived id and a note naming the id it asked for (prefix of the message).

        Raises:
            pymysql.OperationalError: MariaDB unreachable (the runner retries).
        """
        if chosen is None:
            return base, ""
        outcome = await claims.claim(self.db, RequestClaim(
            request_id=chosen, content_sha256=None, task=None, door="kafka", origin=_origin(record)))
        if outcome.kind != "conflict":
            return base, ""
        derived = derived_request_id(record.topic, record.partition, record.offset)
        return (base.model_copy(update={"request_id": derived}),
                f"{outcome.reason}: this submission ends under its derived request id {derived}; ")

    async def _accept(self, event: SubmitEvent, base: RequestEvent,
                      trusted: bool = False) -> tuple[RequestEvent, bytes]:
        """The checked request of ``event`` and its image bytes (a document is split from them).
        ``trusted``: its ``image_uri`` is the HTTP door's content object (a verified claim), read
        outside the allowed prefixes.

        With ``split_documents`` a PDF or TIFF is checked against the document limits
        (:meth:`~services.common.images.decoding.DecoderPool.document_plan`: page count and total pixels
        before any page is rendered); other images as before.

        Raises:
            OcrError: the input's error (refused with its code).
        """
        try:  # the task and its parameters, before the image is read (docs/tasks.md)
            params = self.s.check_task(event.task, event.task_params)
        except TaskError as exc:
            raise OcrError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        limits = self.s.limits
        if event.image_b64 is not None:
            try:
                data = event.image_bytes()
            except (ValueError, binascii.Error) as exc:
                raise OcrError(ErrorCode.INVALID_REQUEST, f"image_b64 is not valid base64: {exc}") from exc
        else:
            if not trusted and (outside := reference_problem(event.image_uri, self.allowed)) is not None:
                raise OcrError(ErrorCode.IMAGE_URI_NOT_ALLOWED, outside)  # before any S3 call
            data = await self.store.get_uri(event.image_uri, max_bytes=limits.max_image_bytes)
        info = None
        if self.s.split_documents and len(data) <= limits.max_image_bytes:
            info = (await self.decoder.document_plan(data)).info
        acc = await accept_image(data, limits, self.store, self.decoder, info=info)
        return base.model_copy(
            update={
                "content_sha256": acc.content_sha256, "image_uri": acc.image_uri, "size_bytes": acc.size_bytes,
                "format": acc.info.format, "width": acc.info.width, "height": acc.info.height,
                "frames": acc.info.frames, "task_params": params,
            }
        ), data

    async def close(self) -> None:
        """Stop the decoder processes."""
        await self.decoder.close()

    def poison(self, record: Record, exc: BaseException, attempts: int) -> list[Outgoing]:
        """DLQ the submission and fail its request: the id it named (a missing object: claimed
        without content before it was retried), or the id derived from its offset (no id, an
        invalid one: the one its other outcomes use), with its callback URL and options, so its
        webhook fires too."""
        _, request, _, _ = _parse(record)
        return poison_messages(stage="ingest", topics=self.s.topics, record=record, exc=exc, attempts=attempts,
                               request=request)


def _unverified(base: RequestEvent, record: Record, err: OcrError) -> tuple[RequestEvent, ErrorCode, str]:
    """A marked submission the HTTP door did not make: ``(request, code, message)`` of its error
    result, under its derived id (it may not end the id it named)."""
    derived = derived_request_id(record.topic, record.partition, record.offset)
    return (base.model_copy(update={"request_id": derived, "api_key_id": None}), err.code,
            f"{err.message}; this submission ends under its derived request id {derived}")


def _origin(record: Record) -> str:
    """The record's place in Kafka, ``topic/partition/offset``: the same for its redeliveries."""
    return f"{record.topic}/{record.partition}/{record.offset}"


def _submitted_at(event: SubmitEvent | None, record: Record) -> int:
    """When the request was submitted, ms: the event's ``submitted_at_ms`` when the submitter set
    it, else the record's Kafka timestamp (its producer's create time, or the broker's append
    time under ``LogAppendTime``), so ``total`` counts the wait in ``ocr.submit``."""
    if event is not None and "submitted_at_ms" in event.model_fields_set:
        return event.submitted_at_ms
    return record.timestamp_ms if record.timestamp_ms and record.timestamp_ms > 0 else now_ms()


def _request_of(event: SubmitEvent, rid: str, record: Record) -> RequestEvent:
    """The request a submission starts, under ``rid``."""
    return RequestEvent(request_id=rid, task=event.task, task_params=event.task_params, source=event.source, filename=event.filename,
                        callback_url=event.callback_url, submitted_at_ms=_submitted_at(event, record),
                        metadata=event.metadata, job_id=event.job_id,
                        priority=request_priority(event.priority, event.job_id))


def _parse(record: Record) -> tuple[SubmitEvent | None, RequestEvent, str | None, str | None]:
    """``(event, request, chosen id, problem)`` of a submit record, from its bytes (``raw``).

    ``event`` is None when the record is refused as it stands (``problem`` says why): not JSON
    (e.g. a lone surrogate escape, which orjson refuses), not an object, an invalid
    ``request_id`` (:func:`schemas.ids.chosen_request_id_problem`: the rule, and not a page id's
    form) or another schema error.
    ``chosen`` is the record's own ``request_id`` when it follows the rule (else None);
    ``request`` is the request its outcome belongs to, under ``chosen`` or else the derived id,
    with the record's other options when they are valid (callback URL, source, metadata ...).
    """
    derived = derived_request_id(record.topic, record.partition, record.offset)
    bare = RequestEvent(request_id=derived, submitted_at_ms=_submitted_at(None, record))
    if record.raw is None:
        return None, bare, None, "the record has no value"
    try:
        value = orjson.loads(record.raw)
    except orjson.JSONDecodeError as exc:
        return None, bare, None, f"not JSON: {exc}"
    if not isinstance(value, dict):
        return None, bare, None, f"not a JSON object but {type(value).__name__}"
    rid = value.get("request_id")
    if rid is not None and (bad := chosen_request_id_problem(rid)) is not None:
        try:  # its other options still travel with the error (a webhook, metadata)
            rest = SubmitEvent.model_validate({**value, "request_id": None})
            return None, _request_of(rest, derived, record), None, bad
        except ValidationError:
            return None, bare, None, bad
    try:
        event = SubmitEvent.model_validate(value)
    except ValidationError as exc:
        job = value.get("job_id")  # the error still counts in its job when the job id itself is valid
        return None, bare.model_copy(update={"request_id": rid or derived,
                                             "job_id": job if is_request_id(job) else None}), rid, str(exc)
    return event, _request_of(event, event.request_id or derived, record), event.request_id, None
