"""Event models carried on the ocrstream topics (pydantic v2, frozen, JSON via orjson).

Every event carries ``schema`` (name and version) and ``event_id``. Changes are additive;
a breaking change gets a new schema name. JSON Schema files for non-Python producers and
consumers are generated into ``schemas/jsonschema/`` by ``python -m schemas.generate``.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, Tag, model_validator

from schemas.errors import ErrorCode
from schemas.ids import REQUEST_ID_MAX_LENGTH, REQUEST_ID_PATTERN, is_page_request_id
from schemas.jobs import JobCompletedEvent, JobEvent, JobId
from schemas.lanes import Priority
from schemas.reading import (
    WARNINGS_DOC,
    ErrorInfo,
    FrozenModel,
    Line,
    Page,
    RawOutput,
    TaskAnswer,
)
from schemas.tasks import TaskParams


def new_id() -> str:
    """A random 32-hex-digit id (UUID4 without dashes)."""
    return uuid.uuid4().hex


def now_ms() -> int:
    """Wall-clock time as integer milliseconds since the Unix epoch."""
    return int(time.time() * 1000)


# The task's parameters (schemas/tasks.py), defined once: on the submission, the request, the result
# document and the stored output (the task's answer: schemas.reading.TaskAnswer).
TaskParamsField = Annotated[TaskParams | None, Field(
    description="the task's parameters (extract: fields; translate: target_lang); schemas/tasks.py")]
JobIdField = Annotated[JobId | None, Field(
    description="the job the request belongs to (docs/jobs.md); null: none")]


# The document fields (docs/documents.md), defined once: on the request and the result document.
DocumentId = Annotated[str | None, Field(
    default=None, description="a page of a document (a PDF or multi-page TIFF split at ingest), or the document "
    "itself: the document's request id; null for a lone image")]
PageNumber = Annotated[int | None, Field(
    default=None, ge=1, description="a page of a document: its 1-based page number; null on the document and on a "
    "lone image")]
PageCount = Annotated[int | None, Field(
    default=None, ge=1, description="a document and each of its pages: the document's number of pages")]


class SubmitEvent(FrozenModel):
    """An image submitted upstream on ``ocr.submit`` (read by ingest).

    Exactly one of ``image_b64`` (inline bytes, base64; keep under ~700 KiB so the Kafka
    message stays below the broker's 1 MiB default) or ``image_uri`` (``s3://bucket/key``).
    ``request_id`` makes the submission idempotent (the rule: :mod:`schemas.ids`; not of a page
    id's form, ``<document id>:p<n>``, which the split gives); when absent,
    ingest derives one from the message's topic, partition and offset so a replay never creates
    a second request. ``submitted_at_ms`` left out: ingest takes the record's Kafka timestamp.
    """

    schema_: Literal["ocr.submit.v1"] = Field(default="ocr.submit.v1", alias="schema")
    event_id: str = Field(default_factory=new_id)
    request_id: str | None = Field(default=None, min_length=1, max_length=REQUEST_ID_MAX_LENGTH,
                                   pattern=REQUEST_ID_PATTERN)
    image_b64: str | None = None
    image_uri: str | None = Field(default=None, max_length=1100, pattern=r"^s3://[^/]{1,63}/.{1,1024}$",
                                  description="s3://<bucket>/<key>: a bucket name of 1 to 63 characters and an S3 "
                                              "object key of 1 to 1,024 (S3's own limits)")
    filename: str | None = Field(default=None, max_length=512)
    task: str = Field(default="ocr", max_length=64)
    task_params: TaskParamsField = None
    source: str = Field(default="default", max_length=64)
    callback_url: str | None = Field(default=None, max_length=2048)
    submitted_at_ms: int = Field(default_factory=now_ms, ge=0, le=253_402_300_799_999,
                                 description="when the submitter sent it, epoch ms (0 to the end of year 9999)")
    metadata: dict[str, str] = Field(default_factory=dict)
    job_id: JobIdField = None
    door: Literal["kafka", "http"] = Field(
        default="kafka", description="http: published by the HTTP door for a document it stored (docs/documents.md); "
        "ingest verifies the claim (the door's request_claims row and the object's SHA-256) or refuses it with "
        "http_door_unverified")
    api_key_id: str | None = Field(
        default=None, max_length=64, description="the API key of an HTTP door submission (door http); verified "
        "like door")
    priority: Priority | None = Field(
        default=None, description="the lane the request is read in: interactive (read before bulk work, with "
        "slots of its own) or bulk; null: bulk for a request in a job, interactive otherwise (a document's pages "
        "are always bulk; docs/delivery.md)")

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    @model_validator(mode="after")
    def _one_image(self) -> "SubmitEvent":
        if self.request_id is not None and is_page_request_id(self.request_id):
            raise ValueError("request_id has the form of a document page's id (<document id>:p<page>), which "
                             "ocrstream gives the pages it splits")
        if (self.image_b64 is None) == (self.image_uri is None):
            raise ValueError("exactly one of image_b64 or image_uri is required")
        if sum(len(k) + len(v) for k, v in self.metadata.items()) > 16_384:
            raise ValueError("metadata is limited to 16 KiB")
        if self.image_uri is not None and any(
                seg in (".", "..") for seg in self.image_uri.split("/", 3)[3].split("/")):
            # S3 keys are flat names, but S3-compatible servers (MinIO) refuse these outright
            raise ValueError("image_uri: the object key has a '.' or '..' path segment")
        return self

    def image_bytes(self) -> bytes:
        """Decode the inline image (standard base64 alphabet, RFC 4648 section 4; ASCII
        whitespace such as the line breaks of MIME base64, RFC 2045 section 6.8, is ignored).

        Raises:
            ValueError: if the event has no inline image or the base64 is invalid.
        """
        if self.image_b64 is None:
            raise ValueError("event has no inline image")
        b64 = self.image_b64
        if not b64.isalnum():  # fast path: no "+", "/", "=" or whitespace to look at
            b64 = "".join(b64.split())
        return base64.b64decode(b64, validate=True)


class RequestEvent(FrozenModel):
    """An accepted request on ``ocr.requests`` (keyed by ``content_sha256``).

    The image lives in S3 at ``image_uri`` (claim check); only metadata rides on Kafka.
    Image fields are None only for requests rejected at ingest (they go straight to results).
    """

    schema_: Literal["ocr.request.v1"] = Field(default="ocr.request.v1", alias="schema")
    event_id: str = Field(default_factory=new_id)
    request_id: str
    content_sha256: str | None = None
    image_uri: str | None = None
    size_bytes: int = 0
    format: str | None = None
    width: int | None = None
    height: int | None = None
    frames: int = 1
    task: str = "ocr"
    task_params: TaskParamsField = None
    source: str = "default"
    filename: str | None = None
    callback_url: str | None = None
    submitted_at_ms: int = Field(default_factory=now_ms)
    accepted_at_ms: int = Field(default_factory=now_ms)
    timings_ms: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    traceparent: str | None = Field(
        default=None,
        description="W3C trace context of the request's trace (set by ingest); keeps a request completed "
        "on another's behalf (a single-flight waiter) in its own trace",
    )
    api_key_id: str | None = Field(
        default=None, description="id of the API key that submitted the request over HTTP (None: Kafka or no auth)"
    )
    job_id: JobIdField = None
    document_id: DocumentId = None
    page_number: PageNumber = None
    page_count: PageCount = None
    priority: Priority = Field(
        default="bulk", description="the lane the request is read in: dedup sends an interactive miss to "
        "ocr.infer-interactive, a bulk one to ocr.infer (docs/delivery.md)")

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class InferEvent(FrozenModel):
    """A cache miss sent to inference on ``ocr.infer`` (keyed by content SHA-256).

    ``attempt`` counts promotions: a waiter re-sent after the lease holder failed has attempt > 1.
    """

    schema_: Literal["ocr.infer.v1"] = Field(default="ocr.infer.v1", alias="schema")
    event_id: str = Field(default_factory=new_id)
    request: RequestEvent
    cache_key: str
    attempt: int = Field(default=1, ge=1)
    enqueued_at_ms: int = Field(default_factory=now_ms)

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


CACHE_TIERS = ("lru", "redis", "s3", "settled", "single_flight", "near", "fields")
"""Where a cache hit was answered from (``cache_tier``): ``lru`` dedup's in-process memory (L1),
``redis`` the Redis entry (L2), ``s3`` the stored result document (L3), ``settled`` dedup's window
of keys settled a moment ago, ``single_flight`` the result of the copy that was computed while this
one waited, ``near`` a verified near duplicate's result, ``fields`` (``extract``) a stored extraction
of the image holding every field asked (of another field list: ``docs/tasks.md``). Tiers as named in
``design/ARCHITECTURE.md`` (L1 in-process, L2 Redis, L3 the object store)."""

CacheTier = Literal["lru", "redis", "s3", "settled", "single_flight", "near", "fields"]



class _ResultEventBody(FrozenModel):
    """The fields of :class:`ResultEvent` but its task answer (:class:`TaskAnswer`)."""


    schema_: Literal["ocr.result.v1"] = Field(default="ocr.result.v1", alias="schema")
    event_id: str = Field(default_factory=new_id)
    request: RequestEvent
    cache_key: str | None = None
    cache_hit: bool = False
    cache_tier: CacheTier | None = Field(default=None, description="on a cache hit, where it was answered from (CACHE_TIERS)")
    near_duplicate_of: str | None = Field(
        default=None, description="SHA-256 of the image whose result was reused, boxes rescaled (near-duplicate hit)"
    )
    status: Literal["ok", "error"]
    error: ErrorInfo | None = None
    engine: str | None = None
    model: str | None = None
    model_revision: str | None = None
    pages: list[Page] = Field(default_factory=list)
    lines: list[Line] = Field(default_factory=list)
    raw_output: RawOutput = None
    warnings: list[str] = Field(default_factory=list, description=WARNINGS_DOC)
    result_uri: str | None = None
    cacheable: bool = Field(
        default=True,
        description="false: computed by an infer whose cache generation differs from cache_key's (a rolling "
                    "upgrade); the sink completes the request but stores nothing under the key (its output goes "
                    "to the request's own object, which the key's waiters are answered from)",
    )
    attempt: int = 1
    timings_ms: dict[str, float] = Field(default_factory=dict)
    produced_at_ms: int = Field(default_factory=now_ms)

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class ResultEvent(TaskAnswer, _ResultEventBody):
    """The outcome for one request on ``ocr.results`` (read by sink).

    From infer: ``lines``/``pages`` filled. From dedup on a cache hit: ``cache_hit`` true and
    ``result_uri`` points at the stored result document; on a near-duplicate hit, ``cache_hit``
    true, ``near_duplicate_of`` set and ``lines``/``pages`` filled (the other image's lines,
    boxes rescaled to this image). From ingest on bad input: status error.
    """



class _ResultDocumentBody(FrozenModel):
    """The fields of :class:`ResultDocument` but its task answer (:class:`TaskAnswer`)."""


    schema_: Literal["ocr.result_document.v1"] = Field(default="ocr.result_document.v1", alias="schema")
    request_id: str
    status: Literal["ok", "error", "partial"] = Field(
        description="ok, error, or for a document partial: some pages failed, fewer than "
                    "OCRSTREAM_MAX_PAGE_ERROR_RATE allows (failed_pages lists them)")
    error: ErrorInfo | None = None
    content_sha256: str | None = None
    cache_key: str | None = None
    cache_hit: bool = False
    cache_tier: CacheTier | None = Field(default=None, description="on a cache hit, where it was answered from (CACHE_TIERS)")
    near_duplicate_of: str | None = Field(
        default=None, description="set when the result is another image's (a verified near duplicate: re-encoded "
        "or rescaled copy), boxes rescaled to this image: that image's SHA-256"
    )
    engine: str | None = None
    model: str | None = None
    model_revision: str | None = None
    width: int | None = None
    height: int | None = None
    pages: list[Page] = Field(default_factory=list)
    lines: list[Line] = Field(default_factory=list)
    text: str = ""
    raw_output: RawOutput = None
    warnings: list[str] = Field(default_factory=list, description=WARNINGS_DOC)
    task: str = "ocr"
    task_params: TaskParamsField = None
    source: str = "default"
    filename: str | None = None
    result_uri: str | None = None
    submitted_at_ms: int | None = None
    completed_at_ms: int | None = None
    timings_ms: dict[str, float] = Field(default_factory=dict)
    trace_id: str | None = None
    callback_url: str | None = None
    api_key_id: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    lines_omitted: int = Field(
        default=0, ge=0,
        description="lines left out of `lines` to keep this document within the database row bound "
                    "(OCRSTREAM_MYSQL__ROW_MAX_BYTES); the whole OCR output (ocr.output.v1) is at result_uri; 0 = none")
    text_truncated: bool = Field(
        default=False,
        description="true: `text` was cut at its end to keep this document within the database row bound; the "
                    "whole text is in the OCR output at result_uri")
    job_id: JobIdField = None
    document_id: DocumentId = None
    page_number: PageNumber = None
    page_count: PageCount = None
    failed_pages: list[int] = Field(
        default_factory=list, description="a document: the 1-based numbers of its pages that ended in error")

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class ResultDocument(TaskAnswer, _ResultDocumentBody):
    """The final result of one request: in MariaDB, on ``ocr.completed`` and in the CLI's output.

    A document (a PDF or multi-page TIFF split at ingest, ``docs/documents.md``) has one of its
    own, assembled when every page is final: ``status`` ``ok``, ``partial`` (some pages failed:
    ``failed_pages``) or ``error``; its lines carry their page number; ``result_uri`` points at
    the whole assembled result (``ocr.document.v1``) and this document is its bounded summary.

    Attributes:
        lines: Text lines in reading order (top-to-bottom, then left-to-right), boxes in pixels
            of the upright page given by ``line.page``.
        text: All lines joined with newlines; pages separated by a blank line.
        width, height: Size of page 1 in pixels (upright); every page in ``pages``.
        timings_ms: Where the time went, in ms: ``queue_<stage>`` waits (from Kafka timestamps),
            ``ingest``, ``dedup``, ``fetch``, ``decode``, ``preprocess``, ``inference`` (the
            engine's time for this image's pages), ``postprocess``, ``engine_wait`` (in infer,
            waiting for decoded-pixel room or a free engine slot), ``write`` and ``total``
            (submit to completion).
        trace_id: The request's OpenTelemetry trace id (32 hex digits).
        callback_url: Where the completion is delivered as a signed webhook (HTTP submissions).
        api_key_id: The API key that submitted the request over HTTP, when keys are required.
        metadata: The submitter's own key/value pairs, returned unchanged.
        lines_omitted, text_truncated: Set when the document was over the database row bound:
            the row (and the completion built from it) keeps the summary, ``result_uri`` the whole.
    """



class _OcrOutputBody(FrozenModel):
    """The fields of :class:`OcrOutput` but its task answer (:class:`TaskAnswer`)."""


    schema_: Literal["ocr.output.v1"] = Field(default="ocr.output.v1", alias="schema")
    cache_key: str
    content_sha256: str
    engine: str
    model: str
    model_revision: str
    task: str
    task_params: TaskParamsField = None
    pages: list[Page]
    lines: list[Line]
    text: str
    raw_output: RawOutput = None
    created_at_ms: int = Field(default_factory=now_ms)
    near_duplicate_of: str | None = Field(
        default=None, description="SHA-256 of the image this output was copied from (near duplicate), boxes rescaled"
    )
    warnings: list[str] = Field(default_factory=list, description=WARNINGS_DOC)

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class OcrOutput(TaskAnswer, _OcrOutputBody):
    """The OCR output of one image under one cache generation, stored once in S3 at
    ``results/<sha256>/<gen_id>.json`` and shared by every request for those bytes."""



class _DocumentPageBody(FrozenModel):
    """The fields of :class:`DocumentPage` but its task answer (:class:`TaskAnswer`)."""


    page_number: int = Field(ge=1)
    request_id: str
    status: Literal["ok", "error"]
    error: ErrorInfo | None = None
    content_sha256: str | None = None
    result_uri: str | None = None
    cache_hit: bool = False
    width: int | None = None
    height: int | None = None
    lines: list[Line] = Field(default_factory=list)
    text: str = ""
    warnings: list[str] = Field(default_factory=list, description=WARNINGS_DOC)


class DocumentPage(TaskAnswer, _DocumentPageBody):
    """One page of an assembled document (:class:`DocumentResult`): its own request's outcome.

    Attributes:
        page_number: 1-based.
        request_id: The page's own request (``schemas.ids.page_request_id``).
        status: ``ok`` or ``error``; ``error`` says why.
        content_sha256: The rendered (PDF) or extracted (TIFF) page's SHA-256: its image is at
            ``images/<sha[:2]>/<sha>``.
        result_uri: The page's stored OCR output (``ocr.output.v1``), shared by every copy of it.
        cache_hit: The page was answered from a cache tier (an identical page computed once).
        width, height: The page's size in pixels.
        lines: Its lines, ``page`` set to ``page_number``; text and task output as the page's own result.
    """



class DocumentResult(FrozenModel):
    """A document's whole assembled result, in page order: at ``documents/<document_id>.json`` in S3,
    written once by the sink when the last page is final (``docs/documents.md``). Its content is
    taken from the pages' stored final states only (no clock at assembly), so a replay writes the
    same bytes; the first written is kept.

    Attributes:
        status: ``ok`` (every page ok), ``partial`` or ``error`` (by ``OCRSTREAM_MAX_PAGE_ERROR_RATE``).
        text: The pages' texts in page order, separated by a blank line.
        completed_at_ms: When its last page completed (the latest of the pages' completion times).
    """

    schema_: Literal["ocr.document.v1"] = Field(default="ocr.document.v1", alias="schema")
    document_id: str
    status: Literal["ok", "error", "partial"]
    error: ErrorInfo | None = None
    content_sha256: str | None = None
    filename: str | None = None
    task: str = "ocr"
    task_params: TaskParamsField = None
    page_count: int = Field(ge=1)
    pages_ok: int = Field(ge=0)
    failed_pages: list[int] = Field(default_factory=list)
    text: str = ""
    pages: list[DocumentPage]
    submitted_at_ms: int | None = None
    completed_at_ms: int | None = None

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class SettledEvent(FrozenModel):
    """A cache key's computation has ended: on ``ocr.requests`` itself, keyed by content SHA-256
    like the key's requests, so it lands on their partition after every request of the key
    produced before it, and the dedup process that owns the partition reads the key's requests
    and its settlement in one order (:data:`RequestLogEvent`).

    Emitted by the sink once the result is durable (S3 document, MariaDB rows, and the Redis entry
    when Redis answers), for every result computed under a cache key (and every error of one),
    never for a cache hit. Dedup completes the key's waiting copies from it.

    Attributes:
        cache_key: The key settled.
        request_id: The request whose result this is (the holder's, normally).
        status: ``ok`` or ``error``.
        error: The error, on ``error``.
        attempt: The attempt that produced it (``InferEvent.attempt``).
        cacheable: False for output of another generation (it is not stored under the key).
        result_uri: The stored output (``ok``): the key's result document, or with ``cacheable``
            false the request's own output object.
        near: True when the result was a near duplicate's (its image is not indexed itself).
    """

    schema_: Literal["ocr.settled.v1"] = Field(default="ocr.settled.v1", alias="schema")
    event_id: str = Field(default_factory=new_id)
    cache_key: str
    content_sha256: str
    request_id: str
    status: Literal["ok", "error"]
    error: ErrorInfo | None = None
    attempt: int = Field(default=1, ge=1)
    cacheable: bool = True
    result_uri: str | None = None
    engine: str | None = None
    model: str | None = None
    model_revision: str | None = None
    near: bool = False
    settled_at_ms: int = Field(default_factory=now_ms)

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class CompletedEvent(FrozenModel):
    """One completion on ``ocr.completed`` (keyed by request id) for downstream systems.

    ``event_id`` is derived from the request id, so a replayed completion is byte-for-byte the
    same event apart from Kafka metadata: consumers deduplicate on ``event_id``.
    """

    schema_: Literal["ocr.completed.v1"] = Field(default="ocr.completed.v1", alias="schema")
    event_id: str
    request_id: str
    result: ResultDocument

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class DlqEvent(FrozenModel):
    """A message a stage gave up on, on ``ocr.dlq``, with the original bytes and the reason."""

    schema_: Literal["ocr.dlq.v1"] = Field(default="ocr.dlq.v1", alias="schema")
    event_id: str = Field(default_factory=new_id)
    stage: str
    topic: str
    partition: int
    offset: int
    key_b64: str | None = None
    value_b64: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    reason: str
    error_code: ErrorCode
    attempts: int = 1
    request_id: str | None = None
    failed_at_ms: int = Field(default_factory=now_ms)

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


def _request_log_tag(value: object) -> str:
    """The ``schema`` of a record of ``ocr.requests``; a record that names none is a settlement when
    it has a ``cache_key`` (which a request never has), else a request."""
    if isinstance(value, dict):
        return value.get("schema") or ("ocr.settled.v1" if "cache_key" in value else "ocr.request.v1")
    return getattr(value, "schema_", "ocr.request.v1")


class RequestLogEvent(RootModel[Annotated[
        Annotated[RequestEvent, Tag("ocr.request.v1")] | Annotated[SettledEvent, Tag("ocr.settled.v1")],
        Discriminator(_request_log_tag)]]):
    """A record of ``ocr.requests``: a request (``ocr.request.v1``, from ingest or the HTTP door) or
    a cache key's settlement (``ocr.settled.v1``, from the sink), told apart by ``schema`` (a
    record without one: by its ``cache_key``, which only a settlement has). Both are keyed by
    content SHA-256: one log per key, read by dedup in order (docs/single-flight.md). ``root`` is
    the event."""


#: Every wire model, by schema name (used by the JSON Schema generator and the drift test).
ALL_EVENTS: dict[str, type[BaseModel]] = {
    "ocr.submit.v1": SubmitEvent,
    "ocr.request.v1": RequestEvent,
    "ocr.infer.v1": InferEvent,
    "ocr.result.v1": ResultEvent,
    "ocr.result_document.v1": ResultDocument,
    "ocr.output.v1": OcrOutput,
    "ocr.completed.v1": CompletedEvent,
    "ocr.dlq.v1": DlqEvent,
    "ocr.settled.v1": SettledEvent,
    "ocr.job.v1": JobEvent,
    "ocr.job_completed.v1": JobCompletedEvent,
    "ocr.document.v1": DocumentResult,
}
