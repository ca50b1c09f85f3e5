"""The HTTP front door of the ingest stage (FastAPI): submit, wait, read; no Kafka needed by callers.

Routes (all JSON; errors are ``{"error": {"code", "message"}}``, see :mod:`.errors`):

* ``POST /v1/ocr`` — one image, as the raw body (options in the query string) or as
  ``multipart/form-data`` (a file part plus option fields). The byte limit is enforced while
  reading (413 before the body is read when ``Content-Length`` is over it). A cached image is
  answered at once with 200 and the finished result; otherwise the image is checked from its
  header, stored once under its SHA-256 and sent on ``ocr.requests``: 202 with the request id.
  A raw body (or a multipart file part) reaching ``OCRSTREAM_HTTP_STREAM_PART_BYTES`` is not kept
  in memory: it streams to an S3 multipart upload under the staging prefix (and a spool file) while it is read and
  hashed, and becomes the content object only once it is known to be new and valid
  (:class:`~services.ingest.api.uploads.StagedBody`, :func:`~services.ingest.accept.accept_staged`).
* ``POST /v1/ocr/batch`` — many images in one multipart body; one item per file (each file part
  read as a ``POST /v1/ocr`` file part is: :func:`~services.ingest.api.forms.read_multipart`).
* ``GET /v1/ocr/{request_id}?wait=S`` — the request's state; with ``wait`` the call returns as
  soon as the completion arrives on ``ocr.completed`` (or after S seconds, still pending).
* ``GET /v1/events?id=A&id=B...`` — server-sent events (``text/event-stream``): one event per id
  with its state now, then one ``completed`` per request as it finishes, then ``end``
  (:mod:`.events`). Batch answers link to it.
* ``GET /healthz``, ``GET /readyz``, ``GET /metrics``; ``GET /`` the web page.

A request answered from the cache still gets its row in MariaDB, its completion on
``ocr.completed`` and its webhook: the door publishes the cache hit on ``ocr.results`` for
the sink, without waiting for the broker's acknowledgement (the caller already has the result).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated
from urllib.parse import urlencode

import orjson
from aiokafka import AIOKafkaProducer
from fastapi import FastAPI, Path as PathParam, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, Field, StringConstraints, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas.events import (
    CompletedEvent, OcrOutput, RequestEvent, ResultDocument, ResultEvent, new_id, now_ms,
)
from schemas.ids import REQUEST_ID_MAX_LENGTH, REQUEST_ID_PATTERN
from schemas.keys import image_object_key
from services.common.app import kafka_reachable, setup_logging
from services.common import claims
from services.common.cache import CacheUnavailable, ResultCache
from services.common.claims import RequestClaim
from services.common.db import Database
from services.common.errors import OcrError
from services.common.events import dumps
from services.common.kafka import make_producer
from services.common.outputs import OutputLru
from services.common.s3 import ObjectStore
from services.common.settings import CommonSettings, load_settings
from services.common.telemetry import SpanKind, Telemetry
from services.common.decoding import DecoderPool
from services.ingest.accept import accept_image, accept_staged
from services.ingest.api.auth import Guard, Limit, Principal
from services.ingest.api.errors import (
    STATUS_OF_CODE, ApiError, api_error_handler, http_error_handler, internal_error_handler, validation_error_handler,
)
from services.ingest.api.events import ID_PATTERN, MEDIA_TYPE, EventStream, Watch, progress
from services.ingest.api.hub import CompletionHub
from services.ingest.api.models import (
    ApiErrorBody, ApiErrorDetail, BatchItem, BatchLinks, BatchResponse, Health, Links, OcrResponse,
)
from services.ingest.api.settings import ApiSettings
from services.ingest.api.forms import read_multipart
from services.ingest.api.uploads import (
    MULTIPART_OVERHEAD, Upload, UploadGate, expected_hold, read_raw,
)
from services.ingest.api.webhooks import WebhookDispatcher, validate_callback_url

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
#: The web page talks to its own origin only: no CDN, no external fonts (works offline).
_PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
             "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_ERROR_TEXT = {
    409: "the `request_id` is already used by another request, submitted here or on the Kafka door: another API "
         "key's, or one for a different image (another content SHA-256) or task (`request_id_conflict`); resending "
         "the same image with it is an idempotent retry",
    400: "bad request: an invalid option or parameter (`invalid_request`), an empty body (`empty_input`), "
         "a malformed multipart body, a callback URL that is not allowed (`callback_not_allowed`)",
    401: "missing, unknown or revoked API key (`unauthorized`)",
    404: "no such request, or another key's request (`not_found`); for `GET /v1/events`: none of the ids is",
    408: "the request body came too slowly (`request_timeout`): not within `OCRSTREAM_HTTP_BODY_TIMEOUT_S`, a pause "
         "over `OCRSTREAM_HTTP_BODY_IDLE_TIMEOUT_S`, or under `OCRSTREAM_HTTP_BODY_MIN_RATE_BYTES_PER_S` on average",
    413: "over a limit: bytes (`input_too_large`), pixels (`image_too_large`) or pages (`too_many_pages`)",
    415: "not a supported image or PDF, or an unsupported Content-Type (`unsupported_format`)",
    422: "the image header is readable but the image is not (`corrupt_image`)",
    429: "the key's rate limit or quota is used up (`rate_limited`, `quota_exceeded`; a batch costs one token and one "
         "submission per image), or the key or client address already has its uploads in progress "
         "(`too_many_uploads`); see Retry-After",
    503: "Kafka, S3 or MariaDB did not answer (`unavailable`), or the upload budget is full, or too many long-polls and "
         "event streams are waiting (`overloaded`); retry later (Retry-After when known)",
}


def _errors(*statuses: int) -> dict[int | str, dict]:
    """OpenAPI ``responses`` entries for these error statuses, all with the ``ApiErrorBody`` shape."""
    return {st: {"model": ApiErrorBody, "description": _ERROR_TEXT[st]} for st in statuses}
_RAW_TYPES = ("image/", "application/pdf", "application/octet-stream")
#: ``GET /v1/events``' ``id`` parameter (their number is checked in the route: a setting bounds it).
_EventIds = Annotated[list[Annotated[str, StringConstraints(pattern=ID_PATTERN)]], Query(
    alias="id", min_length=1,
    description="a request id; repeat the parameter for each request, at most `OCRSTREAM_HTTP_BATCH_MAX_FILES` "
                "(64) distinct ids (duplicates count once)")]
#: ``GET /v1/events``' 200 answer, as documented in the spec.
_EVENTS_TEXT = (
    "`text/event-stream` (WHATWG HTML, server-sent events). First one event per id, in the order asked: "
    "`completed` (already finished), `pending`, or `error` (`not_found`: unknown, or another key's). Then one "
    "`completed` per request as it finishes. `id:` is the request id; `data:` is one line of JSON: for "
    "`completed` and `pending` the body `GET /v1/ocr/{request_id}` answers, for `error` "
    '`{"request_id", "error": {"code", "message"}}`. A `: keep-alive` comment line follows every '
    "`OCRSTREAM_HTTP_EVENTS_KEEPALIVE_S` (15) seconds of silence. Last, `end` once no request is pending or "
    'after `timeout`: `{"reason": "done"|"timeout", "completed": [ids], "pending": [ids], "not_found": [ids]}`; '
    "then the server closes the stream. An `EventSource` reconnects by itself: close it on `end`, or let it "
    "reconnect, which watches the requests still pending and gets 204 once none is."
)


def _query(name: str, description: str, max_length: int | None = None) -> dict:
    schema = {"type": "string"} | ({"maxLength": max_length} if max_length else {})
    return {"in": "query", "name": name, "required": False, "description": description, "schema": schema}


#: ``POST /v1/ocr``'s query options for a raw body (multipart sends them as form fields instead).
_SUBMIT_PARAMS = [
    _query("task", "what to do with the image (part of the cache key): one of the deployment's tasks "
                   "(`OCRSTREAM_TASKS`), else 400 `invalid_request`; default `ocr`", 64),
    _query("source", "where the image comes from (picks the cache TTL); default `http`", 64),
    _query("filename", "the image's file name, kept with the result", 512),
    _query("callback_url", "webhook URL for the completion (its host must be on the allow-list; refused, 400 "
                           "`invalid_request`, when the server's webhooks are disabled)", 2048),
    _query("request_id", "your own id for the request: resubmitting it with the same image answers its state "
                         "instead of sending it again; with a different image, 409 `request_id_conflict`", 64),
    _query("metadata", "JSON object of strings, kept with the result (16 KiB at most)"),
]


class SubmitOptions(BaseModel):
    """Options of one submission (query string for a raw body, form fields for multipart);
    the same constraints as ``SubmitEvent``."""

    # the rule of both doors (schemas/ids.py): not only dots, "." and ".." are not path segments a client can GET
    request_id: str | None = Field(default=None, min_length=1, max_length=REQUEST_ID_MAX_LENGTH,
                                   pattern=REQUEST_ID_PATTERN)
    task: str = Field(default="ocr", min_length=1, max_length=64)
    source: str = Field(default="http", min_length=1, max_length=64)
    filename: str | None = Field(default=None, max_length=512)
    callback_url: str | None = Field(default=None, max_length=2048)
    metadata: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def parse(cls, fields: dict[str, str], settings: CommonSettings) -> "SubmitOptions":
        """From query/form fields; ``metadata`` is a JSON object of strings; ``task`` must be one
        of ``settings.tasks``.

        Raises:
            ApiError: 400 ``invalid_request`` naming the bad field.
        """
        data: dict = {k: v for k, v in fields.items() if k in cls.model_fields and v != ""}
        if "metadata" in data:
            try:
                data["metadata"] = orjson.loads(data["metadata"])
            except orjson.JSONDecodeError:
                raise ApiError(400, "invalid_request", "metadata must be a JSON object of strings") from None
        try:
            opts = cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(400, "invalid_request", f"{where}: {first['msg']}") from None
        if sum(len(k) + len(v) for k, v in opts.metadata.items()) > 16_384:
            raise ApiError(400, "invalid_request", "metadata is limited to 16 KiB")
        if (refused := settings.task_error(opts.task)) is not None:
            raise ApiError(400, "invalid_request", refused)
        return opts


class FrontDoor:
    """Clients and logic behind the routes (one per process).

    Args:
        settings: The door's settings.
    """

    def __init__(self, settings: ApiSettings):
        s = self.s = settings
        self.telemetry = Telemetry("api", s.telemetry)
        self.producer: AIOKafkaProducer | None = None  # Kafka clients need the running loop: made in start()
        # cache hits go out fire-and-forget on their own producer with a longer linger: batching
        # them costs the caller nothing and saves a produce request per hit (bench/http_bench.py)
        self.hit_producer: AIOKafkaProducer | None = None
        self.store = ObjectStore(s.s3, self.telemetry)
        self.cache = ResultCache(s.redis, self.telemetry, stage="api")
        self.db = Database(s.mysql, pool_size=8, telemetry=self.telemetry)
        self.hub: CompletionHub | None = None
        self.guard = Guard(s, self.cache, self.db, self.telemetry)
        self.webhooks = WebhookDispatcher(s, self.db, self.telemetry) if s.webhook_enabled else None
        self._outputs = OutputLru(self.store, s.http_result_lru_entries, s.http_result_lru_bytes)
        self._sends: set[asyncio.Future] = set()  # cache hits being published on ocr.results
        self.uploads = UploadGate(s.http_upload_budget_bytes, s.http_small_upload_budget_bytes, s.http_small_body_bytes,
                                  s.http_uploads_per_client, s.http_uploads_per_key)
        self.pace = s.body_pace()
        self.decoder = DecoderPool(s.decode, s.limits)  # format checks in killable processes
        self.started = asyncio.Event()
        self.closing = asyncio.Event()  # set at SIGTERM (serve): event streams end at once
        self._loop: asyncio.AbstractEventLoop | None = None
        r = self.telemetry.registry
        self.http_requests = Counter("ocrstream_http_requests", "HTTP submissions and reads by outcome",
                                     ["route", "outcome"], registry=r)
        self.http_staged = Counter("ocrstream_http_staged_uploads", "Uploads (raw bodies, file parts) streamed to S3 by how "
                                   "their multipart upload ended: completed, aborted, abort_failed",
                                   ["outcome"], registry=r)
        self.http_seconds = Histogram("ocrstream_http_seconds", "Time to answer, by route and outcome",
                                      ["route", "outcome"], registry=r,
                                      buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30, 60))
        Gauge("ocrstream_http_waiters", "Completion waiters held: one per long-poll, one per request an event "
              "stream watches", registry=r).set_function(lambda: self.hub.waiting if self.hub else 0)
        self.http_streams = Gauge("ocrstream_http_event_streams", "GET /v1/events streams open", registry=r)
        held = Gauge("ocrstream_http_upload_held_bytes", "Bytes of request bodies held in memory now, by budget: "
                     "uploads (OCRSTREAM_HTTP_UPLOAD_BUDGET_BYTES), small (OCRSTREAM_HTTP_SMALL_UPLOAD_BUDGET_BYTES)",
                     ["budget"], registry=r)
        held.labels("uploads").set_function(lambda: self.uploads.budget.used)
        held.labels("small").set_function(lambda: self.uploads.small.used if self.uploads.small is not None else 0)
        Gauge("ocrstream_http_uploads_open", "Uploads (POST /v1/ocr and /v1/ocr/batch bodies) admitted and not yet "
              "ended", registry=r).set_function(lambda: self.uploads.open_uploads)
        self.telemetry.ready_checks.append(self.started.is_set)

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect Kafka (producer and completion reader), start probes and webhook delivery.

        Raises:
            aiokafka.errors.KafkaError: Kafka unreachable (the process exits; k8s restarts it).
        """
        self._loop = asyncio.get_running_loop()
        self.producer = make_producer(self.s.kafka, client_id="ocrstream-api")
        await self.producer.start()
        self.hit_producer = make_producer(self.s.kafka, client_id="ocrstream-api-hits", linger_ms=self.s.http_hit_linger_ms)
        await self.hit_producer.start()
        self.hub = CompletionHub(self.s, self.s.http_max_waiters)
        await self.hub.start()
        await self.decoder.start()
        self.telemetry.add_probe("kafka", lambda: kafka_reachable(self.s.kafka.bootstrap_servers))
        self.telemetry.add_probe("s3", self.store.ping)
        if self.webhooks:
            await self.webhooks.start()
        self.started.set()
        log.info("api: listening on http://%s:%d", self.s.http_host, self.s.http_port)

    def begin_close(self) -> None:
        """The process was told to stop (SIGTERM): end every event stream now, without its ``end``
        event, so an ``EventSource`` reconnects to another replica, and answer every long-poll
        ``pending`` now (the client asks again, elsewhere), instead of holding uvicorn's graceful
        shutdown for ``shutdown_timeout_s`` and then cutting them off. Safe to call
        from a signal handler (it only schedules the work on the door's loop); idempotent."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.closing.set)

    async def stop(self) -> None:
        """Stop webhook delivery and the reader, flush the producers, close the pools.

        Cache hits already answered but not yet in the hit producer's buffer (a send waits for
        room while its partition's batch is full) are awaited first: aiokafka refuses messages
        once ``stop()`` has begun (``ProducerClosed``), and each such hit would lose its row.
        Each send ends within the producer's ``request_timeout_ms``.
        """
        self.started.clear()
        if self.webhooks:
            await self.webhooks.stop()
        await self.hub.stop()
        if self._sends:
            await asyncio.wait(set(self._sends))
        await self.hit_producer.stop()  # flushes the cache hits still lingering
        await self.producer.stop()
        await self.decoder.close()
        await self.cache.close()
        self.telemetry.close()

    # -- helpers ------------------------------------------------------------------------------
    def count_staged(self, outcome: str) -> None:
        """Count how a streamed upload's multipart upload ended (``completed``, ``aborted``, ``abort_failed``)."""
        self.http_staged.labels(outcome).inc()

    def links(self, rid: str) -> Links:
        return Links(self=f"/v1/ocr/{rid}", wait=f"/v1/ocr/{rid}?wait={int(self.s.http_wait_max_s)}")

    def events_link(self, rids: list[str]) -> str:
        """``GET /v1/events`` for these ids (the server's longest timeout: its default)."""
        return "/v1/events?" + urlencode([("id", rid) for rid in rids])

    @staticmethod
    def _owns(principal: Principal, key_id: str | None) -> bool:
        """Whether the caller may see a request made with API key ``key_id`` (keys off: all)."""
        return principal.key_id is None or key_id == principal.key_id

    async def _known(self, rid: str, principal: Principal) -> ResultDocument | bool | None:
        """The finished document, True if accepted and pending (or unknowable: Redis down), False if
        unknown, None if the id is another API key's (read answers it 404, submit 409)."""
        doc = await self.db.get_request(rid)
        if doc is not None:
            return doc if self._owns(principal, doc.api_key_id) else None
        return await self._pending(rid, principal)

    async def _known_many(self, rids: list[str], principal: Principal) -> dict[str, ResultDocument | bool | None]:
        """:meth:`_known` of many ids: one MariaDB query, then Redis for those not finished.

        Raises:
            pymysql.MySQLError | OSError: MariaDB did not answer.
        """
        docs = await self.db.get_requests(rids)
        rest = [rid for rid in rids if rid not in docs]
        states = await asyncio.gather(*(self._pending(rid, principal) for rid in rest))
        known: dict[str, ResultDocument | bool | None] = dict(zip(rest, states))
        known.update({rid: doc if self._owns(principal, doc.api_key_id) else None for rid, doc in docs.items()})
        return known

    async def _pending(self, rid: str, principal: Principal) -> bool | None:
        """For an id with no result row: True if accepted (or unknowable: Redis down), False if
        unknown, None if another API key's. Redis's marker first; an id it does not know may
        still be claimed (:mod:`services.common.claims`: chosen at the Kafka door, or the marker
        lost), which MariaDB says."""
        try:
            raw = await self.cache.accepted(rid)
        except CacheUnavailable:
            return True
        if raw is None:
            held = await claims.held_claim(self.db, rid)
            if held is None:
                return False
            return True if self._owns(principal, held.api_key_id) else None
        owner = orjson.loads(raw).get("key")
        return True if self._owns(principal, owner) else None

    # -- submit -------------------------------------------------------------------------------
    async def submit(self, up: Upload, opts: SubmitOptions, principal: Principal,
                     traceparent: str | None, limit: Limit | None = None) -> tuple[int, OcrResponse]:
        """One image: 200 + result when cached, 202 + request id when queued.

        ``limit``: the caller's rate limit and quota, when not yet taken (a small body read
        first): taken in the same Redis call as the cache lookup; 429 ``rate_limited`` /
        ``quota_exceeded`` before anything is stored or sent.

        Raises:
            ApiError: 4xx for bad input or options (nothing is stored or sent then): 400
                ``callback_not_allowed`` for a callback URL the guard refuses, then 400
                ``invalid_request`` for any ``callback_url`` while ``webhook_enabled`` is off; 409
                ``request_id_conflict`` for a ``request_id`` another request holds, from either
                door (another API key, another image's content SHA-256, another task); 503
                ``unavailable`` when Kafka or S3 does not take the request, or MariaDB cannot
                claim a chosen ``request_id``.
        """
        started = time.perf_counter()
        submitted = now_ms()
        if limit is not None and (opts.callback_url or opts.request_id or not self.s.cache_enabled):
            await self.guard.take(limit)  # their checks come first; no lookup to share the call with
            limit = None
        if opts.callback_url:  # URL checks, then webhooks enabled here, then a secret to sign with
            await validate_callback_url(opts.callback_url, self.s, principal.key_id, enabled=self.webhooks is not None)
        # the door's own ids are random (UUID4, 122 bits), never claimed: no other request can know one in advance
        rid = opts.request_id or new_id()
        mine: RequestClaim | None = None
        if opts.request_id:  # idempotent: a known id is answered with its state, not sent again
            known, mine = await self._claim_id(rid, principal, up.sha256, opts.task)
            if isinstance(known, ResultDocument):
                return 200, self._done(known)
            if known:
                return 202, OcrResponse(request_id=rid, status="pending", links=self.links(rid))
        try:
            return await self._submit(up, opts, principal, traceparent, rid, started, submitted, limit)
        except BaseException:
            if mine is not None:  # not accepted after all: free the id so the client's retry is sent
                try:
                    await claims.release(self.db, mine)
                except Exception as exc:  # noqa: BLE001 - the id stays taken by this image (a retry with it is sent)
                    log.warning("api: could not release request_id %r after a failed submission: %r", rid, exc)
            raise

    async def _claim_id(self, rid: str, principal: Principal, sha: str,
                        task: str) -> tuple[ResultDocument | bool, RequestClaim | None]:
        """Claim a client-chosen id in MariaDB (:func:`services.common.claims.claim`, the rule
        both doors share): ``(False, claim)`` if this call took it (the caller releases it if the
        submission fails); ``(document, None)`` or ``(True, None)`` for a retry of a finished or a
        pending request (the same image, task and API key: a resend, or a twin sent at the same
        moment, at either door).

        Raises:
            ApiError: 409 ``request_id_conflict`` when another request holds the id (another
                image, task or API key; on either door); 503 ``unavailable`` when MariaDB does not
                answer (a chosen id is claimed durably, or not taken).
        """
        mine = RequestClaim(request_id=rid, content_sha256=sha, task=task, door="http", api_key_id=principal.key_id)
        try:
            outcome = await claims.claim(self.db, mine)
        except Exception as exc:  # noqa: BLE001 - MariaDB down or failing: nothing was taken or sent
            raise ApiError(503, "unavailable", f"the request_id could not be claimed (MariaDB): {exc!r}",
                           {"Retry-After": "1"}) from None
        if outcome.kind == "new":
            return False, mine
        if outcome.kind == "conflict":  # answering it would hand back another request's result
            raise ApiError(409, "request_id_conflict", f"{outcome.reason}; choose a new request_id")
        try:
            doc = await self.db.get_request(rid)
        except Exception:  # noqa: BLE001 - MariaDB just answered the claim: treat as still pending
            doc = None
        return (doc if doc is not None else True), None

    async def _submit(self, up: Upload, opts: SubmitOptions, principal: Principal, traceparent: str | None,
                      rid: str, started: float, submitted: int,
                      limit: Limit | None) -> tuple[int, OcrResponse]:
        gen = self.s.generation(opts.task)
        key = self.s.cache_key_of(up.sha256, gen, principal.key_id)  # the caller's cache scope
        parent = [("traceparent", traceparent.encode())] if traceparent else None
        with self.telemetry.span("api.submit", parent_headers=parent, kind=SpanKind.SERVER,
                                 attributes={"ocrstream.request_id": rid}):
            base = RequestEvent(
                request_id=rid, content_sha256=up.sha256, image_uri=self.store.uri(image_object_key(up.sha256)),
                size_bytes=up.size_bytes, task=opts.task, source=opts.source,
                filename=opts.filename or up.filename, callback_url=opts.callback_url, submitted_at_ms=submitted,
                metadata=opts.metadata, traceparent=self.telemetry.traceparent(), api_key_id=principal.key_id,
            )
            # on a hit the id is remembered in the same round trip, so GET knows it until the sink stores its row
            marker = orjson.dumps({"key": principal.key_id, "sha": up.sha256})
            hit = await self._cached(key, rid, marker, limit) if self.s.cache_enabled else None
            if hit is not None:
                answer = self._answer_from_cache(base, key, gen, *hit, started)
                if base.callback_url:
                    # its webhook rides on this publish: answered only once Kafka has it (at least
                    # once, like every other completion), not fire-and-forget as plain hits
                    await self._hit_published(base.request_id)
                return 200, answer
            try:
                if up.staged is not None:  # streamed: checked from its spool file, then made the content object
                    acc = await accept_staged(up.staged.spool, up.staged.size, up.sha256, up.staged.upload,
                                              self.s.limits, self.store, self.decoder)
                else:
                    acc = await accept_image(up.data, self.s.limits, self.store, self.decoder, sha256=up.sha256)
            except OcrError as err:
                if err.code.value in STATUS_OF_CODE:
                    raise ApiError(STATUS_OF_CODE[err.code.value], err.code.value, err.message) from None
                raise ApiError(503, "unavailable", f"the image could not be stored: {err.message}") from None
            except Exception as exc:  # S3 down: nothing was promised yet, the caller may retry
                raise ApiError(503, "unavailable", f"the image could not be stored: {exc!r}") from None
            req = base.model_copy(update={
                "format": acc.info.format, "width": acc.info.width, "height": acc.info.height,
                "frames": acc.info.frames, "accepted_at_ms": now_ms(),
                "timings_ms": {"http": round((time.perf_counter() - started) * 1000, 3)},
            })
            try:
                await self.producer.send_and_wait(self.s.topics.requests, dumps(req), key=up.sha256.encode(),
                                                  headers=self.telemetry.inject())
            except Exception as exc:  # noqa: BLE001 - not acknowledged: not accepted
                raise ApiError(503, "unavailable", f"Kafka did not acknowledge the request: {exc!r}") from None
            await self._mark_accepted(rid, principal, up.sha256)
            return 202, OcrResponse(request_id=rid, status="pending", links=self.links(rid))

    async def _mark_accepted(self, rid: str, principal: Principal, sha: str) -> None:
        try:
            await self.cache.mark_accepted(rid, orjson.dumps({"key": principal.key_id, "sha": sha}),
                                           self.s.http_accepted_ttl_s)
        except CacheUnavailable:
            pass  # GET then treats the id as pending-or-unknown and still waits for it

    async def _cached(self, key: str, rid: str, marker: bytes, limit: Limit | None) -> tuple[str, OcrOutput] | None:
        """(result_uri, output) of a cached result, or None (miss, Redis down, document gone).
        On a hit ``rid`` is marked accepted with ``marker`` (unless empty) in the same Redis call,
        which also takes ``limit`` when given.

        Raises:
            ApiError: 429 when ``limit`` refuses the request.
        """
        if limit is not None and self.guard.limiter is not None:
            decision, entry = await self.guard.limiter.hit_and_lookup(
                limit.key_id, key, rid, marker, self.s.http_accepted_ttl_s, rate_per_s=limit.rate_per_s,
                burst=limit.burst, quota_per_day=limit.quota_per_day)
            self.guard.enforce(limit, decision)
        else:
            try:
                entry = await self.cache.get_and_mark(key, rid, marker, self.s.http_accepted_ttl_s)
            except CacheUnavailable:
                return None
        if entry is None:
            return None
        try:
            return entry.result_uri, await self._outputs.load(entry.result_uri)
        except Exception:  # noqa: BLE001 - a vanished/unreadable document: compute it again
            return None

    def _answer_from_cache(self, base: RequestEvent, key: str, gen, result_uri: str, output: OcrOutput,
                           started: float) -> OcrResponse:
        elapsed = round((time.perf_counter() - started) * 1000, 3)
        req = base.model_copy(update={"timings_ms": {"http": elapsed}})
        ev = ResultEvent(request=req, cache_key=key, cache_hit=True, status="ok", result_uri=result_uri,
                         engine=gen.engine, model=gen.model, model_revision=gen.model_revision)
        fut = asyncio.ensure_future(self.hit_producer.send(self.s.topics.results, dumps(ev), key=req.content_sha256.encode(),
                                                       headers=self.telemetry.inject()))
        fut._ocr_request_id = req.request_id  # found again by _hit_published when there is a callback
        self._sends.add(fut)  # referenced until done (the loop keeps only weak references to tasks)
        fut.add_done_callback(self._sends.discard)
        fut.add_done_callback(self._count_send)
        first = output.pages[0] if output.pages else None
        doc = ResultDocument(
            request_id=req.request_id, status="ok", content_sha256=req.content_sha256, cache_key=key, cache_hit=True,
            engine=gen.engine, model=gen.model, model_revision=gen.model_revision,
            width=first.width if first else None, height=first.height if first else None, pages=output.pages,
            lines=output.lines, text=output.text, warnings=output.warnings, task=req.task, source=req.source,
            filename=req.filename, result_uri=ev.result_uri, submitted_at_ms=req.submitted_at_ms, completed_at_ms=now_ms(),
            timings_ms={"http": elapsed, "total": elapsed}, trace_id=self.telemetry.trace_id(),
            callback_url=req.callback_url, api_key_id=req.api_key_id, metadata=req.metadata,
        )
        return OcrResponse(request_id=req.request_id, status="ok", cache_hit=True, result=doc,
                           links=self.links(req.request_id))

    async def _hit_published(self, request_id: str) -> None:
        """Wait until the cache hit of ``request_id`` just sent is acknowledged by Kafka.

        Raises:
            ApiError: 503 ``unavailable`` when the publish failed (the client retries; its
                ``request_id`` makes the retry idempotent).
        """
        fut = next((f for f in self._sends if getattr(f, "_ocr_request_id", None) == request_id), None)
        if fut is None:
            return
        try:
            await (await fut)
        except Exception as exc:  # noqa: BLE001 - any failure: the completion is not durable
            raise ApiError(503, "unavailable", f"the completion could not be published: {exc!r}") from exc

    def _count_send(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception():
            self.http_requests.labels("submit", "cache_hit_publish_failed").inc()
            log.warning("api: publishing a cache hit failed: %r", None if fut.cancelled() else fut.exception())
            return
        inner = fut.result()  # the broker's acknowledgement, awaited in the background
        inner.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                                or self.http_requests.labels("submit", "cache_hit_publish_failed").inc())

    # -- read ---------------------------------------------------------------------------------
    def _done(self, doc: ResultDocument) -> OcrResponse:
        err = ApiErrorDetail(code=doc.error.code.value, message=doc.error.message) if doc.error else None
        return OcrResponse(request_id=doc.request_id, status=doc.status, cache_hit=doc.cache_hit, result=doc,
                           error=err, links=self.links(doc.request_id))

    async def read(self, rid: str, wait: float, principal: Principal) -> OcrResponse:
        """The request's state, waiting up to ``wait`` seconds for its completion (a wait ends
        early, answering ``pending``, when the door is told to stop: :meth:`begin_close`).

        Raises:
            ApiError: 404 ``not_found`` (unknown id, or another key's request), 503
                ``overloaded`` (too many long-polls) or ``unavailable`` (MariaDB down).
        """
        fut = None
        if wait > 0:
            try:
                fut = self.hub.register(rid)
            except OverflowError as exc:
                raise ApiError(503, "overloaded", str(exc), {"Retry-After": "1"}) from None
        try:
            try:
                known = await self._known(rid, principal)
            except Exception as exc:  # noqa: BLE001 - MariaDB down: only a wait can still answer
                if fut is None:
                    raise ApiError(503, "unavailable", f"results store unavailable: {exc!r}") from None
                known = True
            if isinstance(known, ResultDocument):
                return self._done(known)
            if known is False or known is None:
                raise ApiError(404, "not_found", f"no request {rid!r}")
            if fut is not None:
                if not self.closing.is_set():
                    stop = asyncio.ensure_future(self.closing.wait())
                    try:
                        await asyncio.wait((fut, stop), timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        stop.cancel()
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    ev: CompletedEvent = fut.result()
                    if self._owns(principal, ev.result.api_key_id):
                        return self._done(ev.result)
            return OcrResponse(request_id=rid, status="pending", links=self.links(rid))
        finally:
            if fut is not None:
                self.hub.unregister(rid, fut)

    async def open_events(self, rids: list[str], timeout_s: float, principal: Principal,
                          reconnect: bool) -> EventStream | None:
        """A server-sent event stream of these requests (``GET /v1/events``; :mod:`.events`).

        The hub waiters are registered *before* MariaDB and Redis are read, so a completion that
        lands in between is not missed (as in :meth:`read`). Ids unknown to the caller (no such
        request, or another key's) get an ``error`` event, or 404 when all are.

        Args:
            rids: Distinct request ids, in the order their first events are sent.
            timeout_s: Longest time the stream stays open, s (already capped).
            principal: The caller; sees only its own key's requests.
            reconnect: The client sent ``Last-Event-ID`` (an ``EventSource`` reconnecting).

        Returns:
            The stream; None (answered 204) for a reconnect when no id is pending any more: per
            the WHATWG spec, 204 tells an ``EventSource`` to stop reconnecting.

        Raises:
            ApiError: 503 ``overloaded`` (the ids do not fit under ``http_max_waiters``), 404
                ``not_found`` (no id is the caller's).
        """
        try:
            watch = Watch(self.hub, self.hub.register_many(rids))
        except OverflowError as exc:
            raise ApiError(503, "overloaded", str(exc), {"Retry-After": "1"}) from None
        try:
            try:
                known = await self._known_many(rids, principal)
            except Exception:  # noqa: BLE001 - MariaDB down: only the completions can still answer
                known = {rid: True for rid in rids}
            snapshot = [(rid, known[rid]) for rid in rids]
            if not any(isinstance(state, ResultDocument) or state is True for _, state in snapshot):
                raise ApiError(404, "not_found", f"no request {rids[0]!r}" if len(rids) == 1
                               else f"none of the {len(rids)} requests exists")
            if reconnect and not any(state is True for _, state in snapshot):
                watch.close()
                return None
        except BaseException:
            watch.close()
            raise
        events = progress(
            watch, snapshot, timeout_s=timeout_s, keepalive_s=self.s.http_events_keepalive_s,
            completed=lambda doc: self._done(doc).model_dump_json(by_alias=True).encode(),
            pending=lambda rid: OcrResponse(request_id=rid, status="pending", links=self.links(rid))
            .model_dump_json(by_alias=True).encode(),
            owned=lambda doc: self._owns(principal, doc.api_key_id), closing=self.closing)
        self.http_streams.inc()

        def closed() -> None:
            watch.close()
            self.http_streams.dec()

        return EventStream(events, closed)


class SubmitFastPath:
    """Pure ASGI middleware that sends ``POST /v1/ocr`` straight to its endpoint.

    The endpoint is the same function FastAPI routes to (and documents in the spec); this only
    skips the layers between: route matching, FastAPI's request/response wrapper and parameter
    solving, the exception and exit-stack middlewares. On the cached path those took about 5–10 %
    of the door's CPU per request (py-spy during ``python -m bench.http_bench``).
    :class:`~services.ingest.api.errors.ApiError` is answered here in the one error shape; any
    other exception goes on to Starlette's server-error middleware (500 ``internal_error``,
    :func:`~services.ingest.api.errors.internal_error_handler`), as it would from the route.

    Args:
        app: The rest of the stack.
        endpoint: ``async (Request) -> Response`` for ``POST /v1/ocr``.
    """

    def __init__(self, app, endpoint):
        self.app = app
        self.endpoint = endpoint

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/ocr" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await self.endpoint(request)
        except ApiError as err:
            response = err.response()
        await response(scope, receive, send)


def _json(model: BaseModel, status: int) -> Response:
    # the bytes of model_dump_json(by_alias=True), without its decode to str and Response's encode back
    return Response(model.__pydantic_serializer__.to_json(model, by_alias=True), status_code=status,
                    media_type="application/json")


def _openapi(app: FastAPI) -> dict:
    """FastAPI's spec without the 422 ``HTTPValidationError`` answers it adds to every route with
    parameters: parameter errors are answered 400 ``invalid_request`` in the one error shape
    (:func:`~services.ingest.api.errors.validation_error_handler`). Built once, then cached."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, summary=app.summary, description=app.description,
                           routes=app.routes, tags=app.openapi_tags, openapi_version=app.openapi_version)
        for item in spec.get("paths", {}).values():
            for op in item.values():
                resp = op.get("responses", {}).get("422")
                if resp and "HTTPValidationError" in orjson.dumps(resp).decode():
                    del op["responses"]["422"]
        for name in ("HTTPValidationError", "ValidationError"):
            spec.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = spec
    return app.openapi_schema


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    """The ASGI app. Clients connect in the lifespan (so importing this module is cheap).

    Args:
        settings: Defaults to :class:`ApiSettings` read from the environment.
    """
    s = settings or load_settings(ApiSettings)
    door = FrontDoor(s)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await door.start()
        try:
            yield
        finally:
            await door.stop()

    app = FastAPI(
        title="ocrstream",
        version="1",
        summary="Streaming OCR over Kafka: submit images over HTTP, get results at once, by long-poll or webhook.",
        description=("Submit an image with `POST /v1/ocr` (raw bytes or multipart): a cached image is answered "
                     "200 with its result, a new one 202 with its request id; read it with "
                     "`GET /v1/ocr/{request_id}?wait=S` (long-poll). Every error answers "
                     '`{"error": {"code", "message"}}` with a stable code.'),
        lifespan=lifespan,
        # FastAPI's own request/operation spans (on by itself once a tracer provider is set) would
        # double the door's api.submit SERVER span and cost ~3 extra spans per request on the
        # cached path (measured: bench/http_bench.py); the door traces itself.
        telemetry={"tracing": False},
    )
    app.state.door = door
    app.add_exception_handler(ApiError, api_error_handler)
    # FastAPI's parameter checks and Starlette's 404/405 answer in the one error shape too
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)  # anything else: 500 internal_error, logged
    app.openapi = lambda: _openapi(app)

    @app.post("/v1/ocr", response_model=OcrResponse, status_code=202, tags=["ocr"], summary="Submit one image",
              response_description="accepted: the request id, status `pending` and where to read the result",
              responses={200: {"model": OcrResponse, "description": "cached: the finished result, status `ok`"},
                         **_errors(400, 401, 408, 409, 413, 415, 422, 429, 503)},
              openapi_extra={"parameters": _SUBMIT_PARAMS, "requestBody": {"required": True, "content": {
                  "image/*": {"schema": {"type": "string", "format": "binary"}},
                  "application/pdf": {"schema": {"type": "string", "format": "binary"}},
                  "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                  "multipart/form-data": {"schema": {
                      "type": "object", "required": ["file"],
                      "properties": {"file": {"type": "string", "format": "binary"},
                                     **{k: {"type": "string"} for k in SubmitOptions.model_fields}}}}}}})
    async def submit(request: Request) -> Response:
        """Submit one image: 200 with the result when cached, else 202 with the request id.

        The options are read from the query string by :meth:`SubmitOptions.parse` (their spec is
        ``_SUBMIT_PARAMS``), not by FastAPI's parameter solving: this is the cached hot path."""
        started = time.perf_counter()
        outcome = "error"
        held = None
        up = None
        deferred = reading = None
        try:
            principal, limit = await door.guard.admit(request)
            ctype = request.headers.get("content-type", "").lower()  # media types are case-insensitive (RFC 9110 §8.3.1)
            query = dict(request.query_params)
            multipart = ctype.startswith("multipart/form-data")
            if multipart or ctype.startswith(_RAW_TYPES) or not ctype:
                # before its token: a client with its uploads in progress (429), or a full budget (503), costs nothing
                body_limit = s.limits.max_image_bytes + (MULTIPART_OVERHEAD if multipart else 0)
                held = door.uploads.open(request, principal.key_id,
                                         expected_hold(request, body_limit, s.http_stream_part_bytes))
            if limit is not None and not (_read_first(request, ctype, query) and door.guard.read_first(limit)):
                await door.guard.take(limit)  # before a byte is read: a refused client sends nothing more
                limit = None
            deferred = reading = limit  # not yet taken: taken below if the request fails before the door takes it
            if multipart:
                ups, fields = await read_multipart(request, s.limits.max_image_bytes,
                                                   s.limits.max_image_bytes + MULTIPART_OVERHEAD, 1, held,
                                                   door.pace, store=door.store,
                                                   part_bytes=s.http_stream_part_bytes,
                                                   on_staged_end=door.count_staged)
                up = ups[0]
                opts = SubmitOptions.parse({**query, **fields}, s)
            elif held is not None:
                opts = SubmitOptions.parse(query, s)
                up = await read_raw(request, s.limits.max_image_bytes, held, door.pace, store=door.store,
                                    part_bytes=s.http_stream_part_bytes, on_staged_end=door.count_staged)
            else:
                raise ApiError(415, "unsupported_format", f"Content-Type {ctype!r}: send image bytes or multipart/form-data")
            deferred = None  # the door takes it (with the cache lookup, or first)
            status, body = await door.submit(up, opts, principal, request.headers.get("traceparent"), limit)
            outcome = "cached" if status == 200 else "accepted"
            return _json(body, status)
        except ApiError as err:
            outcome = err.code
            if deferred is not None:  # a bad request still takes its token: 429 wins, as when taken first
                lim, deferred = deferred, None
                try:
                    await door.guard.take(lim)
                except ApiError as refused:
                    outcome = refused.code
                    raise refused from None
            raise
        finally:
            if reading is not None:
                door.guard.done_reading(reading)
            try:
                if up is not None and up.staged is not None:  # aborts the multipart upload unless it became the image
                    await up.staged.discard()
            finally:
                if held is not None:
                    held.release()  # also when the request is cancelled during the discard
            door.http_requests.labels("submit", outcome).inc()
            door.http_seconds.labels("submit", outcome).observe(time.perf_counter() - started)

    def _read_first(request: Request, ctype: str, query: dict[str, str]) -> bool:
        """Whether this submit's rate limit waits for its body: a small raw body (Content-Length
        up to ``rate_limit_read_first_bytes``) whose limit and cache lookup then share one Redis
        call (:meth:`Door._cached`). Not with a ``request_id`` or ``callback_url``, whose checks
        come before the lookup, nor when the cache is off."""
        size = request.headers.get("content-length", "")
        return (s.cache_enabled and size.isdigit() and 0 < int(size) <= s.rate_limit_read_first_bytes
                and (ctype.startswith(_RAW_TYPES) or not ctype) and not query.get("request_id")
                and not query.get("callback_url"))

    # the hot route skips the routing layers (added first: CORS, when on, wraps it)
    app.add_middleware(SubmitFastPath, endpoint=submit)
    if s.http_cors_origins:
        # Retry-After exposed: a page on another origin reads it off a 429/503 (Fetch: not a safelisted header)
        app.add_middleware(CORSMiddleware, allow_origins=s.http_cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Content-Type", "X-API-Key", "Authorization"], expose_headers=["Retry-After"])

    @app.post("/v1/ocr/batch", response_model=BatchResponse, status_code=202, tags=["ocr"],
              summary="Submit many images in one multipart body",
              response_description="at least one item is pending: one item per file, in upload order",
              responses={200: {"model": BatchResponse, "description": "every item finished (cached or rejected)"},
                         **_errors(400, 401, 408, 413, 415, 429, 503)},
              openapi_extra={"parameters": [p for p in _SUBMIT_PARAMS if p["name"] != "request_id"],
                             "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
                  "type": "object", "required": ["files"],
                  "properties": {"files": {"type": "array", "items": {"type": "string", "format": "binary"}},
                                 **{k: {"type": "string"} for k in SubmitOptions.model_fields if k != "request_id"}}}}}}})
    async def submit_batch(request: Request) -> Response:
        """Submit many images in one multipart body (every file part; options shared by all, from the
        query string or form fields as for ``POST /v1/ocr``; a form field wins). A ``request_id``
        is refused: each item gets its own. The batch costs one rate-limit token and one
        submission per image, all or none, charged once its files are read."""
        principal, limit = await door.guard.admit(request)
        await door.guard.peek(limit)  # not even one image would pass: refused before the body is read
        if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            await door.guard.take(limit)  # a bad request costs its token, as a POST /v1/ocr does
            raise ApiError(415, "unsupported_format", "send multipart/form-data with one file part per image")
        held = door.uploads.open(request, principal.key_id, expected_hold(request, s.http_batch_max_bytes))
        try:
            return await _batch(request, principal, limit, held)
        finally:
            held.release()

    async def _batch(request: Request, principal: Principal, limit: Limit | None, held) -> Response:
        decided = False  # whether the batch's charge was decided (taken, or refused by the limit itself)
        try:
            ups, fields = await read_multipart(request, s.limits.max_image_bytes, s.http_batch_max_bytes,
                                               s.http_batch_max_files, held, door.pace, store=door.store,
                                               part_bytes=s.http_stream_part_bytes, on_staged_end=door.count_staged)
            try:
                fields = {**dict(request.query_params), **fields}  # as POST /v1/ocr: the query string, then the form
                if fields.get("request_id"):  # empty = absent, as everywhere else
                    raise ApiError(400, "invalid_request", "request_id names one image: each item of a batch gets its "
                                                           "own (POST /v1/ocr to choose one)")
                opts = SubmitOptions.parse(fields, s)
                decided = True
                await door.guard.charge_batch(limit, len(ups))
                return await _batch_submit(request, principal, ups, opts)
            finally:
                for up in ups:  # aborts each streamed file's multipart upload unless it became its image
                    if up.staged is not None:
                        await up.staged.discard()
        except ApiError:
            if not decided:
                await door.guard.take(limit)  # a bad batch costs one token, as a bad POST /v1/ocr (429 wins)
            raise

    async def _batch_submit(request: Request, principal: Principal, ups: list[Upload], opts: SubmitOptions) -> Response:
        sem = asyncio.Semaphore(s.ingest_concurrency)

        async def one(i: int, up: Upload) -> BatchItem:
            async with sem:
                try:
                    _, res = await door.submit(up, opts, principal, request.headers.get("traceparent"))
                except ApiError as err:
                    return BatchItem(index=i, filename=up.filename, request_id="", status="error",
                                     error=ApiErrorDetail(code=err.code, message=err.message))
                return BatchItem(index=i, filename=up.filename, **res.model_dump(exclude={"links"}), links=res.links)

        items = await asyncio.gather(*(one(i, u) for i, u in enumerate(ups)))
        door.http_requests.labels("batch", "accepted").inc(len(items))
        status = 200 if all(it.status != "pending" for it in items) else 202
        rids = list(dict.fromkeys(it.request_id for it in items if it.request_id))
        links = BatchLinks(events=door.events_link(rids) if rids else None)
        return _json(BatchResponse(items=list(items), links=links), status)

    @app.get("/v1/events", tags=["ocr"], summary="Watch requests finish (server-sent events)",
             response_class=Response,
             responses={200: {"description": _EVENTS_TEXT, "content": {MEDIA_TYPE: {"schema": {"type": "string"}}}},
                        204: {"description": "a reconnect (`Last-Event-ID` sent) after every request has finished: "
                                             "an `EventSource` stops reconnecting"},
                        **_errors(400, 401, 404, 429, 503)})
    async def events(
        request: Request,
        ids: _EventIds,
        timeout: Annotated[float, Query(ge=0, description="seconds the stream stays open at most (capped by "
                                                          "`OCRSTREAM_HTTP_EVENTS_MAX_S`, also the default)")]
        = s.http_events_max_s,
    ) -> Response:
        """Watch many requests finish on one connection: server-sent events, as specified by the WHATWG HTML
        Living Standard, "Server-sent events" (https://html.spec.whatwg.org/multipage/server-sent-events.html).
        Same access rules as ``GET /v1/ocr/{request_id}``: with API keys on, a key sees its own requests only."""
        principal = await door.guard.check(request)
        rids = list(dict.fromkeys(ids))
        if len(rids) > s.http_batch_max_files:
            door.http_requests.labels("events", "invalid_request").inc()
            raise ApiError(400, "invalid_request", f"{len(rids)} request ids: a stream watches at most "
                           f"{s.http_batch_max_files} (OCRSTREAM_HTTP_BATCH_MAX_FILES)")
        try:
            stream = await door.open_events(rids, min(timeout, s.http_events_max_s), principal,
                                            reconnect="last-event-id" in request.headers)
        except ApiError as err:
            door.http_requests.labels("events", err.code).inc()
            raise
        door.http_requests.labels("events", "opened" if stream else "finished").inc()
        return stream if stream is not None else Response(status_code=204)

    @app.get("/v1/ocr/{request_id}", response_model=OcrResponse, tags=["ocr"], summary="Read a request's state",
              response_description="the state: `pending`, or `ok`/`error` with the result document",
              responses=_errors(400, 401, 404, 429, 503))
    async def read(
        request: Request,
        request_id: Annotated[str, PathParam(max_length=64)],
        wait: Annotated[float, Query(ge=0, description="seconds to wait for completion (long-poll)")] = 0,
    ) -> Response:
        """The request's state; ``?wait=S`` returns as soon as it completes, or pending after S seconds."""
        principal = await door.guard.check(request)
        started = time.perf_counter()
        res = await door.read(request_id, min(wait, s.http_wait_max_s), principal)
        door.http_seconds.labels("read", res.status).observe(time.perf_counter() - started)
        return _json(res, 200)

    @app.get("/healthz", response_model=Health, tags=["ops"], summary="Liveness probe",
             response_description="the process answers")
    async def healthz() -> Response:
        """Liveness: the process answers."""
        return _json(Health(ok=True), 200)

    @app.get("/readyz", response_model=Health, tags=["ops"], summary="Readiness probe",
             response_description="ready: Kafka connected, S3 reachable",
             responses={503: {"model": Health, "description": "not ready: `not_ready` names what is missing"}})
    async def readyz() -> Response:
        """Readiness: Kafka connected, S3 reachable."""
        missing = door.telemetry.not_ready()
        return _json(Health(ok=not missing, not_ready=missing), 503 if missing else 200)

    @app.get("/metrics", tags=["ops"], response_class=Response, summary="Prometheus metrics",
             responses={200: {"description": "Prometheus text exposition format 0.0.4",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        """Prometheus metrics of this process."""
        return Response(generate_latest(door.telemetry.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        """The web page (``static/index.html``); its CSP allows requests to this origin only."""
        page = STATIC / "index.html"
        if not page.exists():
            raise ApiError(404, "not_found", "the web page is not installed")
        return FileResponse(page, media_type="text/html", headers={"Content-Security-Policy": _PAGE_CSP})

    # the page's script and style sheet (check_dir=False: a wheel without the page still starts)
    app.mount("/static", StaticFiles(directory=STATIC, check_dir=False), name="static")

    return app


def serve(settings: ApiSettings | None = None) -> None:
    """Run the door with uvicorn until SIGTERM (blocking). At the signal, event streams and
    long-polls end at once (:meth:`FrontDoor.begin_close`); other requests get uvicorn's
    graceful shutdown."""
    import uvicorn

    s = settings or load_settings(ApiSettings)
    setup_logging("api", s.telemetry.log_level)
    app = create_app(s)
    door: FrontDoor = app.state.door

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # uvicorn's SIGTERM/SIGINT handler
            super().handle_exit(sig, frame)
            door.begin_close()

    # the client address (per-client upload slots) is X-Forwarded-For's when the peer is a listed proxy
    config = uvicorn.Config(app, host=s.http_host, port=s.http_port, loop="uvloop", http="httptools",
                            access_log=False, log_config=None, timeout_graceful_shutdown=int(s.shutdown_timeout_s),
                            proxy_headers=True, forwarded_allow_ips=s.http_forwarded_allow_ips)
    Server(config).run()
