"""Submitting: ``POST /v1/ocr`` (one image) and ``POST /v1/ocr/batch`` (many in one multipart body).

An image is read with the byte limit enforced while reading (413 before the body is read when
``Content-Length`` is over it). A cached image is answered at once with 200 and the finished
result; otherwise the image is checked from its header, stored once under its SHA-256 and sent on
``ocr.requests``: 202 with the request id. A raw body (or a multipart file part) reaching
``OCRSTREAM_HTTP_STREAM_PART_BYTES`` is not kept in memory: it streams to an S3 multipart upload
under the staging prefix (and a spool file) while it is read and hashed, and becomes the content
object only once it is known to be new and valid (:class:`~services.api.uploads.StagedBody`,
:func:`~services.common.images.accept.accept_staged`).

A PDF or multi-page TIFF (``http_split_documents``) is checked against the document limits,
stored, its id claimed, and handed to ingest on ``ocr.submit`` marked as the door's, to be split
into pages (``docs/documents.md``): 202, and the id's final state is the assembled document.

A request answered from the cache still gets its row in MariaDB, its completion on
``ocr.completed`` and its webhook: the door publishes the cache hit on ``ocr.results`` for the
sink, without waiting for the broker's acknowledgement (the caller already has the result).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import orjson
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from schemas.errors import ErrorCode, HttpErrorCode, http_status
from schemas.events import OcrOutput, RequestEvent, ResultDocument, SubmitEvent, new_id, now_ms
from schemas.lanes import request_priority
from schemas.keys import image_object_key
from services.api.clients import Clients
from services.api.errors import ApiError
from services.api.forms import read_multipart
from services.api.protocol import (
    ApiErrorDetail, BatchItem, BatchLinks, BatchResponse, OcrResponse, SubmitOptions, query_options,
)
from services.api.serving_jobs import check_job_of
from services.api.serving_keys import Limit, Principal
from services.api.serving_read import ReadService
from services.api.serving_webhooks import validate_callback_url
from services.api.uploads import MULTIPART_OVERHEAD, Upload, expected_hold, read_raw
from services.common.requests import claims
from services.common.images.accept import Accepted, accept_image, accept_staged
from services.common.cache.entries import CacheUnavailable
from services.common.requests.claims import RequestClaim
from services.common.errors import OcrError
from services.common.images.imaging import READ_FORMATS
from services.common.codec import dumps
from services.common.results.build import cache_hit_event, result_document
from services.common.documents.splitting import DOCUMENT_FORMATS
from services.common.telemetry import SpanKind

log = logging.getLogger(__name__)

RAW_TYPES = ("image/", "application/pdf", "application/octet-stream")


def json_response(model: BaseModel, status: int) -> Response:
    """``model`` as a JSON response: the bytes of ``model_dump_json(by_alias=True)``, without its
    decode to str and Response's encode back."""
    return Response(model.__pydantic_serializer__.to_json(model, by_alias=True), status_code=status,
                    media_type="application/json")


def image_error(err: OcrError) -> ApiError:
    """An image check's error as the door answers it: its own code when that is a client error
    (4xx in :data:`schemas.errors.ERRORS`), else 503 ``unavailable`` (the image could not be stored)."""
    status = http_status(err.code)
    if status is not None and 400 <= status < 500:
        return ApiError(err.code, err.message)
    return ApiError(HttpErrorCode.UNAVAILABLE, f"the image could not be stored: {err.message}")


def is_document_file(up: Upload) -> bool:
    """Whether ``up`` starts like a PDF (``%PDF-`` in its first 1,024 bytes, as PDF readers
    look for it) or a TIFF (``II*\\0`` or ``MM\\0*``), from its first bytes only (in memory, or read
    from its spool file): what a cache hit of more than one page is answered as a document for."""
    if up.staged is not None:
        head = os.pread(up.staged.spool.fileno(), 1024, 0)
    else:
        head = up.data[:1024]
    return b"%PDF-" in head or head.startswith((b"II*\x00", b"MM\x00*"))


class SubmitService:
    """One image or a batch, from the body to 200 (cached) or 202 (sent on ``ocr.requests``).

    Args:
        clients: The door's clients.
        reads: Answers for known request ids (a ``request_id`` resent).
    """

    def __init__(self, clients: Clients, reads: ReadService):
        self.c = clients
        self.s = clients.s
        self.reads = reads

    # -- POST /v1/ocr -------------------------------------------------------------------------
    async def handle(self, request: Request) -> Response:
        """``POST /v1/ocr``: 200 with the result when cached, else 202 with the request id.

        The options are read from the query string by :meth:`SubmitOptions.parse` (their spec is
        :func:`~services.api.protocol.submit_parameters`), not by FastAPI's parameter solving.

        Raises:
            ApiError: as :meth:`submit`, and for the body (413, 408, 415, 429 ``too_many_uploads``,
                503 ``overloaded``; 401, 429 from the guard); with API keys on, 404 ``not_found``
                for a ``job_id`` that is not the key's job (:func:`~services.api.serving_jobs.job_for_key`).
        """
        c, s = self.c, self.s
        started = time.perf_counter()
        outcome = "error"
        held = up = deferred = reading = None
        try:
            principal, limit = await c.guard.admit(request)
            ctype = request.headers.get("content-type", "").lower()  # media types are case-insensitive (RFC 9110 §8.3.1)
            query = query_options(request.query_params)
            multipart = ctype.startswith("multipart/form-data")
            if multipart or ctype.startswith(RAW_TYPES) or not ctype:
                # before its token: a client with its uploads in progress (429), or a full budget (503), costs nothing
                body_limit = s.limits.max_image_bytes + (MULTIPART_OVERHEAD if multipart else 0)
                held = c.uploads.open(request, principal.key_id,
                                      expected_hold(request, body_limit, s.http_stream_part_bytes))
            if limit is not None and not (self._read_first(request, ctype, query) and c.guard.read_first(limit)):
                await c.guard.take(limit)  # before a byte is read: a refused client sends nothing more
                limit = None
            deferred = reading = limit  # not yet taken: taken below if the request fails before the door takes it
            if multipart:
                ups, fields = await read_multipart(request, s.limits.max_image_bytes,
                                                   s.limits.max_image_bytes + MULTIPART_OVERHEAD, 1, held,
                                                   c.pace, store=c.store, part_bytes=s.http_stream_part_bytes,
                                                   on_staged_end=c.count_staged)
                up = ups[0]
                opts = SubmitOptions.parse({**query, **fields}, s)
            elif held is not None:
                opts = SubmitOptions.parse(query, s)
                up = await read_raw(request, s.limits.max_image_bytes, held, c.pace, store=c.store,
                                    part_bytes=s.http_stream_part_bytes, on_staged_end=c.count_staged)
            else:
                raise ApiError(ErrorCode.UNSUPPORTED_FORMAT, f"Content-Type {ctype[:100]!r}: send the file's bytes (as "
                               "image/*, application/pdf or application/octet-stream) or multipart/form-data; "
                               f"ocrstream reads {READ_FORMATS}")
            await check_job_of(c, opts.job_id, principal)  # with keys on: the key's own job, else 404
            deferred = None  # the door takes it (with the cache lookup, or first)
            status, body = await self.submit(up, opts, principal, request.headers.get("traceparent"), limit)
            outcome = "cached" if status == 200 else "accepted"
            return json_response(body, status)
        except ApiError as err:
            outcome = err.code
            if deferred is not None:  # a bad request still takes its token: 429 wins, as when taken first
                lim, deferred = deferred, None
                try:
                    await c.guard.take(lim)
                except ApiError as refused:
                    outcome = refused.code
                    raise refused from None
            raise
        finally:
            if reading is not None:
                c.guard.done_reading(reading)
            try:
                if up is not None and up.staged is not None:  # aborts the multipart upload unless it became the image
                    await up.staged.discard()
            finally:
                if held is not None:
                    held.release()  # also when the request is cancelled during the discard
            c.http_requests.labels("submit", outcome).inc()
            c.http_seconds.labels("submit", outcome).observe(time.perf_counter() - started)

    def _read_first(self, request: Request, ctype: str, query: dict[str, str]) -> bool:
        """Whether this submit's rate limit waits for its body: a small raw body (Content-Length
        up to ``rate_limit_read_first_bytes``) whose limit and cache lookup then share one Redis
        call (:meth:`_cached`). Not with a ``request_id`` or ``callback_url``, whose checks
        come before the lookup, nor when the cache is off."""
        s = self.s
        size = request.headers.get("content-length", "")
        return (s.cache_enabled and size.isdigit() and 0 < int(size) <= s.rate_limit_read_first_bytes
                and (ctype.startswith(RAW_TYPES) or not ctype) and not query.get("request_id")
                and not query.get("callback_url"))

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
            await self.c.guard.take(limit)  # their checks come first; no lookup to share the call with
            limit = None
        if opts.callback_url:  # URL checks, then webhooks enabled here, then a secret to sign with
            await validate_callback_url(opts.callback_url, self.s, principal.key_id,
                                        enabled=self.s.webhook_enabled)
        # the door's own ids are random (UUID4, 122 bits), not claimed (but a document's, _send_document): no
        # other request can know one in advance
        rid = opts.request_id or new_id()
        mine: RequestClaim | None = None
        if opts.request_id:  # idempotent: a known id is answered with its state, not sent again
            known, mine = await self._claim_id(rid, principal, up.sha256, opts.task)
            if isinstance(known, ResultDocument):
                return 200, self.reads.done(known)
            if known:
                return 202, self.reads.pending(rid)
        try:
            return await self._submit(up, opts, principal, traceparent, rid, started, submitted, limit)
        except BaseException:
            if mine is not None:  # not accepted after all: free the id so the client's retry is sent
                try:
                    await claims.release(self.c.db, mine)
                except Exception as exc:  # noqa: BLE001 - the id stays taken by this image (a retry with it is sent)
                    log.warning("api: could not release request_id %r after a failed submission: %r", rid, exc)
            raise

    async def _claim_id(self, rid: str, principal: Principal, sha: str,
                        task: str) -> tuple[ResultDocument | bool, RequestClaim | None]:
        """Claim a client-chosen id in MariaDB (:func:`services.common.requests.claims.claim`, the rule
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
            outcome = await claims.claim(self.c.db, mine)
        except Exception as exc:  # noqa: BLE001 - MariaDB down or failing: nothing was taken or sent
            raise ApiError(HttpErrorCode.UNAVAILABLE, f"the request_id could not be claimed (MariaDB): {exc!r}",
                           {"Retry-After": "1"}) from None
        if outcome.kind == "new":
            return False, mine
        if outcome.kind == "conflict":  # answering it would hand back another request's result
            raise ApiError(ErrorCode.REQUEST_ID_CONFLICT, f"{outcome.reason}; choose a new request_id")
        try:
            doc = await self.c.rows.get_request(rid)
        except Exception:  # noqa: BLE001 - MariaDB just answered the claim: treat as still pending
            doc = None
        return (doc if doc is not None else True), None

    async def _submit(self, up: Upload, opts: SubmitOptions, principal: Principal, traceparent: str | None,
                      rid: str, started: float, submitted: int,
                      limit: Limit | None) -> tuple[int, OcrResponse]:
        c, s = self.c, self.s
        gen = s.generation(opts.task, opts.task_params)
        key = s.cache_key_of(up.sha256, gen, principal.key_id)  # the caller's cache scope
        parent = [("traceparent", traceparent.encode())] if traceparent else None
        with c.telemetry.span("api.submit", parent_headers=parent, kind=SpanKind.SERVER,
                              attributes={"ocrstream.request_id": rid}):
            base = RequestEvent(
                request_id=rid, content_sha256=up.sha256, image_uri=c.store.uri(image_object_key(up.sha256)),
                size_bytes=up.size_bytes, task=opts.task, task_params=opts.task_params, source=opts.source,
                filename=opts.filename or up.filename, callback_url=opts.callback_url, submitted_at_ms=submitted,
                metadata=opts.metadata, traceparent=c.telemetry.traceparent(), api_key_id=principal.key_id,
                job_id=opts.job_id, priority=request_priority(opts.priority, opts.job_id),
            )
            # on a hit the id is remembered in the same round trip, so GET knows it until the sink stores its row
            marker = orjson.dumps({"key": principal.key_id, "sha": up.sha256})
            hit = await self._cached(key, rid, marker, limit) if s.cache_enabled else None
            if hit is not None:
                if s.http_split_documents and len(hit[1].pages) > 1 and is_document_file(up):
                    # an assembled document's entry (services/sink/document_cache.py): answered as the document
                    base = base.model_copy(update={"document_id": rid, "page_count": len(hit[1].pages)})
                answer = self._answer_from_cache(base, key, gen, *hit, started)
                if base.callback_url or base.job_id:
                    # its webhook (its job's count) rides on this publish: answered only once Kafka has it (at least
                    # once, like every other completion), not fire-and-forget as plain hits
                    await self._hit_published(base.request_id)
                return 200, answer
            acc = await self._store(up)
            req = base.model_copy(update={
                "format": acc.info.format, "width": acc.info.width, "height": acc.info.height,
                "frames": acc.info.frames, "accepted_at_ms": now_ms(),
                "timings_ms": {"http": round((time.perf_counter() - started) * 1000, 3)},
            })
            if s.http_split_documents and acc.info.format in DOCUMENT_FORMATS and acc.info.frames > 1:
                await self._send_document(req, claimed=bool(opts.request_id))  # ingest splits it
                await self._mark_accepted(rid, principal, up.sha256)
                return 202, self.reads.pending(rid)
            try:
                await c.producer.send_and_wait(s.topics.requests, dumps(req), key=up.sha256.encode(),
                                               headers=c.telemetry.inject())
            except Exception as exc:  # noqa: BLE001 - not acknowledged: not accepted
                raise ApiError(HttpErrorCode.UNAVAILABLE, f"Kafka did not acknowledge the request: {exc!r}") from None
            await self._mark_accepted(rid, principal, up.sha256)
            return 202, self.reads.pending(rid)

    async def _store(self, up: Upload) -> Accepted:
        """Check ``up`` from its header and store it under its SHA-256. With
        ``http_split_documents`` a PDF or TIFF is checked against the document limits (page count,
        every page's and all pages' pixels; nothing rendered), as ingest checks it before a split;
        without it, against ``limits.max_pages`` as one request.

        Raises:
            ApiError: the image's 4xx (:func:`image_error`: 413 ``document_too_many_pages``,
                ``document_too_large``; a page of a document over the pixel limit is left to fail
                alone at ingest, as ingest leaves it; ...); 503 ``unavailable`` when S3
                does not take it.
        """
        c, s = self.c, self.s
        try:
            info = None
            if s.http_split_documents:
                info = (await c.decoder.document_plan(up.staged.spool if up.staged is not None else up.data)).info
            if up.staged is not None:  # streamed: checked from its spool file, then made the content object
                return await accept_staged(up.staged.spool, up.staged.size, up.sha256, up.staged.upload,
                                           s.limits, c.store, c.decoder, info=info)
            return await accept_image(up.data, s.limits, c.store, c.decoder, sha256=up.sha256, info=info)
        except OcrError as err:
            raise image_error(err) from None
        except Exception as exc:  # S3 down: nothing was promised yet, the caller may retry
            raise ApiError(HttpErrorCode.UNAVAILABLE, f"the image could not be stored: {exc!r}") from None

    async def _send_document(self, req: RequestEvent, claimed: bool) -> None:
        """Hand a stored document to ingest: a ``SubmitEvent`` on ``ocr.submit`` marked ``door:
        http`` with the caller's API key, its ``image_uri`` the stored content object. Ingest
        believes the mark from the id's claim (``services/ingest/door.py``), so the id is claimed
        here first unless the client chose it (``claimed``: :meth:`_claim_id` already did).
        Ingest splits it; the sink's assembled document is this id's final state
        (docs/documents.md).

        Raises:
            ApiError: 503 ``unavailable`` when MariaDB cannot claim the id or Kafka does not
                acknowledge the event.
        """
        c = self.c
        if not claimed:  # the door's own random id: always new
            mine = RequestClaim(request_id=req.request_id, content_sha256=req.content_sha256, task=req.task,
                                door="http", api_key_id=req.api_key_id)
            try:
                await claims.claim(c.db, mine)
            except Exception as exc:  # noqa: BLE001 - MariaDB down: nothing was sent
                raise ApiError(HttpErrorCode.UNAVAILABLE, f"the document's request_id could not be claimed "
                               f"(MariaDB): {exc!r}", {"Retry-After": "1"}) from None
        ev = SubmitEvent(request_id=req.request_id, image_uri=req.image_uri, filename=req.filename, task=req.task,
                         task_params=req.task_params, source=req.source, callback_url=req.callback_url,
                         submitted_at_ms=req.submitted_at_ms, metadata=req.metadata, job_id=req.job_id,
                         door="http", api_key_id=req.api_key_id)
        try:
            await c.producer.send_and_wait(self.s.topics.submit, dumps(ev), key=req.request_id.encode(),
                                           headers=c.telemetry.inject())
        except Exception as exc:  # noqa: BLE001 - not acknowledged: not accepted
            raise ApiError(HttpErrorCode.UNAVAILABLE, f"Kafka did not acknowledge the document: {exc!r}") from None

    async def _mark_accepted(self, rid: str, principal: Principal, sha: str) -> None:
        try:
            await self.c.cache.mark_accepted(rid, orjson.dumps({"key": principal.key_id, "sha": sha}),
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
        guard = self.c.guard
        if limit is not None and guard.limiter is not None:
            decision, entry = await guard.limiter.hit_and_lookup(
                limit.key_id, key, rid, marker, self.s.http_accepted_ttl_s, rate_per_s=limit.rate_per_s,
                burst=limit.burst, quota_per_day=limit.quota_per_day)
            guard.enforce(limit, decision)
        else:
            try:
                entry = await self.c.cache.get_and_mark(key, rid, marker, self.s.http_accepted_ttl_s)
            except CacheUnavailable:
                return None
        if entry is None:
            return None
        try:
            return entry.result_uri, await self.c.outputs.load(entry.result_uri)
        except Exception:  # noqa: BLE001 - a vanished/unreadable document: compute it again
            return None

    def _answer_from_cache(self, base: RequestEvent, key: str, gen, result_uri: str, output: OcrOutput,
                           started: float) -> OcrResponse:
        c = self.c
        elapsed = round((time.perf_counter() - started) * 1000, 3)
        req = base.model_copy(update={"timings_ms": {"http": elapsed}})
        ev = cache_hit_event(req, key, "redis", gen, result_uri=result_uri)
        c.hits.send(req.request_id, dumps(ev), key=req.content_sha256.encode(), headers=c.telemetry.inject())
        doc = result_document(req, ev, output, cache_hit=True, stored_uri=result_uri, completed_at_ms=now_ms(),
                              trace_id=c.telemetry.trace_id(), total_ms=elapsed)
        return OcrResponse(request_id=req.request_id, status="ok", cache_hit=True, result=doc,
                           links=c.links(req.request_id))

    async def _hit_published(self, request_id: str) -> None:
        """Wait until the cache hit of ``request_id`` just sent is acknowledged by Kafka.

        Raises:
            ApiError: 503 ``unavailable`` when the publish failed (the client retries; its
                ``request_id`` makes the retry idempotent).
        """
        try:
            await self.c.hits.published(request_id)
        except Exception as exc:  # noqa: BLE001 - any failure: the completion is not durable
            raise ApiError(HttpErrorCode.UNAVAILABLE, f"the completion could not be published: {exc!r}") from exc

    # -- POST /v1/ocr/batch -------------------------------------------------------------------
    async def handle_batch(self, request: Request) -> Response:
        """Submit many images in one multipart body (every file part; options shared by all, from the
        query string or form fields as for ``POST /v1/ocr``; a form field wins). A ``request_id``
        is refused: each item gets its own. The batch costs one rate-limit token and one
        submission per image, all or none, charged once its files are read.

        Raises:
            ApiError: 415 (not multipart), 401/429 from the guard, and the body's errors.
        """
        c = self.c
        principal, limit = await c.guard.admit(request)
        await c.guard.peek(limit)  # not even one image would pass: refused before the body is read
        if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            await c.guard.take(limit)  # a bad request costs its token, as a POST /v1/ocr does
            raise ApiError(ErrorCode.UNSUPPORTED_FORMAT, "send multipart/form-data with one file part per image; "
                                                         f"ocrstream reads {READ_FORMATS}")
        held = c.uploads.open(request, principal.key_id, expected_hold(request, self.s.http_batch_max_bytes))
        try:
            return await self._batch(request, principal, limit, held)
        finally:
            held.release()

    async def _batch(self, request: Request, principal: Principal, limit: Limit | None, held) -> Response:
        c, s = self.c, self.s
        decided = False  # whether the batch's charge was decided (taken, or refused by the limit itself)
        try:
            ups, fields = await read_multipart(request, s.limits.max_image_bytes, s.http_batch_max_bytes,
                                               s.http_batch_max_files, held, c.pace, store=c.store,
                                               part_bytes=s.http_stream_part_bytes, on_staged_end=c.count_staged)
            try:
                fields = {**query_options(request.query_params), **fields}  # as POST /v1/ocr: the query string, then the form
                if fields.get("request_id"):  # empty = absent, as everywhere else
                    raise ApiError(ErrorCode.INVALID_REQUEST, "request_id names one image: each item of a batch "
                                                              "gets its own (POST /v1/ocr to choose one)")
                opts = SubmitOptions.parse(fields, s)
                await check_job_of(c, opts.job_id, principal)  # with keys on: the key's own job, else 404
                decided = True
                await c.guard.charge_batch(limit, len(ups))
                if opts.priority is None:  # several images in one call: bulk unless asked
                    opts.priority = "bulk"
                return await self._batch_submit(request, principal, ups, opts)
            finally:
                for up in ups:  # aborts each streamed file's multipart upload unless it became its image
                    if up.staged is not None:
                        await up.staged.discard()
        except ApiError:
            if not decided:
                await c.guard.take(limit)  # a bad batch costs one token, as a bad POST /v1/ocr (429 wins)
            raise

    async def _batch_submit(self, request: Request, principal: Principal, ups: list[Upload],
                            opts: SubmitOptions) -> Response:
        sem = asyncio.Semaphore(self.s.http_batch_concurrency)

        async def one(i: int, up: Upload) -> BatchItem:
            async with sem:
                try:
                    _, res = await self.submit(up, opts, principal, request.headers.get("traceparent"))
                except ApiError as err:
                    return BatchItem(index=i, filename=up.filename, request_id="", status="error",
                                     error=ApiErrorDetail(code=err.code, message=err.message))
                return BatchItem(index=i, filename=up.filename, **res.model_dump(exclude={"links"}), links=res.links)

        items = await asyncio.gather(*(one(i, u) for i, u in enumerate(ups)))
        self.c.http_requests.labels("batch", "accepted").inc(len(items))
        status = 200 if all(it.status != "pending" for it in items) else 202
        rids = list(dict.fromkeys(it.request_id for it in items if it.request_id))
        links = BatchLinks(events=self.c.events_link(rids) if rids else None)
        return json_response(BatchResponse(items=list(items), links=links), status)
