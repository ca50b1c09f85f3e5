"""Reading uploads with the byte limit enforced while reading, and hashing as the bytes arrive;
a raw body larger than one S3 part is streamed to S3 (and a spool file) while it is read.
``multipart/form-data`` bodies are read by :mod:`services.ingest.api.forms`, which streams
large file parts the same way (:class:`PartSplitter`, :class:`StagedBody`)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from services.common.s3 import MultipartUpload, ObjectStore
from services.ingest.api.errors import ApiError

log = logging.getLogger(__name__)

#: Room for multipart boundaries, part headers and option fields on top of the image bytes.
MULTIPART_OVERHEAD = 64 * 1024
#: S3's smallest part (every part of a multipart upload but the last), bytes.
MIN_PART_BYTES = 5 * 1024 * 1024


@dataclass(frozen=True)
class Upload:
    """One uploaded image: its SHA-256 (hex, computed while reading when possible), the client's
    file name, and its bytes: in ``data``, or (a raw body or file part of one S3 part or more)
    in ``staged`` with ``data`` empty."""

    data: bytes
    sha256: str
    filename: str | None
    staged: StagedBody | None = None

    @property
    def size_bytes(self) -> int:
        """Length of the upload, bytes."""
        return self.staged.size if self.staged is not None else len(self.data)


class UploadBudget:
    """Bytes of request bodies held in memory at once by this process, across all requests.

    Each request takes a :class:`Reservation`, charged chunk by chunk as its body arrives and
    released when the request ends; a chunk that would pass the budget fails the request with
    503 ``overloaded`` (and ``Retry-After``) instead of letting many large uploads exhaust memory.

    Args:
        limit: Bytes; 0 = unbounded.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def reservation(self) -> "Reservation":
        """A per-request account; call :meth:`Reservation.release` when the request ends."""
        return Reservation(self)


class Reservation:
    """One request's share of an :class:`UploadBudget`.

    It charges the budget ``held = max(reserved, in_memory)`` bytes: what :meth:`admit` set
    aside before the body was read, or what the body holds in memory right now if that is more.
    A request admitted with what it will need therefore never runs out half-way: when the budget
    is short, new requests are refused at admission (503 before their body is read) instead of
    cutting off uploads already in progress.
    """

    def __init__(self, budget: UploadBudget):
        self.budget = budget
        self.held = 0
        self.reserved = 0
        self.in_memory = 0

    def _settle(self) -> None:
        need = max(self.reserved, self.in_memory)
        b = self.budget
        if need > self.held and b.limit and b.used + need - self.held > b.limit:
            raise ApiError(503, "overloaded", f"uploads in progress already hold {b.used} bytes (limit {b.limit}); retry shortly",
                           {"Retry-After": "1"})
        b.used += need - self.held
        self.held = need

    def admit(self, n: int) -> None:
        """Set aside ``n`` bytes for this request's body before it is read (at most the whole
        budget, so a request is never refused by an idle budget); ``admit(0)`` once the body is
        read leaves charged only what it holds in memory.

        Raises:
            ApiError: 503 ``overloaded`` when they do not fit in the budget now.
        """
        if self.budget.limit:
            n = min(n, self.budget.limit)
        old, self.reserved = self.reserved, n
        try:
            self._settle()
        except ApiError:
            self.reserved = old
            raise

    def take(self, n: int) -> None:
        """``n`` more bytes of the body are in memory (charged beyond the reservation only).

        Raises:
            ApiError: 503 ``overloaded`` when they pass the reservation and the budget is full.
        """
        self.in_memory += n
        try:
            self._settle()
        except ApiError:
            self.in_memory -= n
            raise

    def give(self, n: int) -> None:
        """``n`` bytes left memory (a part sent to S3): given back to the budget down to the
        reservation, never below zero."""
        self.in_memory -= min(n, self.in_memory)
        self._settle()

    def release(self) -> None:
        """Give back everything this request took (idempotent)."""
        self.budget.used -= self.held
        self.held = self.reserved = self.in_memory = 0


#: Room for what a streamed body holds besides its two parts (the chunks being read), bytes.
STREAM_SLACK = 256 * 1024


def expected_hold(request: Request, limit: int, part_bytes: int = 0) -> int:
    """The most a request's body will hold in memory, from its ``Content-Length``: the whole
    body, or for a body that will stream to S3 (``part_bytes`` > 0 and the body at least one
    part: a raw body, or a multipart body with one file part) about two parts
    (:class:`StagedBody`). Without a length (``Transfer-Encoding: chunked``) and ``part_bytes``
    > 0, the most any such body can hold, ``min(limit, 2 * part_bytes + STREAM_SLACK)``: set
    aside at admission, it is never the one refused half-way when the budget fills. 0 when the
    length is malformed or over ``limit`` (the reading refuses those), or absent with
    ``part_bytes`` 0 (a batch: charged as it goes, since its worst case is the whole batch).

    Args:
        limit: The byte limit of the body.
        part_bytes: The stream part size; 0 for bodies that may hold all their bytes (a batch:
            its file parts under one S3 part each stay in memory).
    """
    declared = request.headers.get("content-length")
    if declared is None:
        return min(limit, 2 * part_bytes + STREAM_SLACK) if part_bytes else 0
    try:
        n = int(declared)
    except ValueError:
        return 0
    if n < 0 or n > limit:
        return 0
    if part_bytes and n >= part_bytes:
        return min(n, 2 * part_bytes + STREAM_SLACK)
    return n


def too_large(limit: int) -> ApiError:
    """413 ``input_too_large``: an upload (body or file part) passed ``limit`` bytes."""
    return ApiError(413, "input_too_large", f"the upload exceeds the limit of {limit} bytes")


def check_declared_length(request: Request, limit: int) -> None:
    """Refuse at once (413) when ``Content-Length`` already says the body is over ``limit`` bytes,
    before a byte of it is read.

    Raises:
        ApiError: 413 ``input_too_large``; 400 ``invalid_request`` for a malformed header.
    """
    declared = request.headers.get("content-length")
    if declared is None:
        return
    try:
        n = int(declared)
    except ValueError:
        raise ApiError(400, "invalid_request", "Content-Length is not a number") from None
    if n > limit:
        raise too_large(limit)


async def limited_stream(request: Request, limit: int, budget: Reservation | None = None,
                         timeout_s: float | None = None) -> AsyncIterator[bytes]:
    """The request body in chunks as they arrive, stopping with 413 as soon as more than
    ``limit`` bytes came (chunked uploads have no Content-Length to check up front).

    Args:
        timeout_s: The whole body must arrive within this many seconds (None = no limit), so a
            client trickling bytes (slowloris) cannot hold a connection and its budget forever.

    Raises:
        ApiError: 413 ``input_too_large``; 503 ``overloaded`` when ``budget`` runs out; 408
            ``request_timeout`` when the body is not complete within ``timeout_s``; 499
            ``client_closed`` when the client went away first (nginx's status: no one reads it).
    """
    check_declared_length(request, limit)
    seen = 0
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    chunks = request.stream().__aiter__()
    while True:
        try:
            if deadline is None:
                chunk = await chunks.__anext__()
            else:
                async with asyncio.timeout_at(deadline):  # no task per chunk, unlike wait_for
                    chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise ApiError(408, "request_timeout", f"the body did not arrive within {timeout_s:g} s") from None
        except ClientDisconnect:  # not a server error: counted, no traceback logged, nothing answered
            raise ApiError(499, "client_closed", "the client closed the connection before the body was complete") from None
        seen += len(chunk)
        if seen > limit:
            raise too_large(limit)
        if budget is not None:
            budget.take(len(chunk))
        yield chunk


class PartSplitter:
    """Cuts a stream of chunks into multipart parts of at least ``size`` bytes.

    A part is handed out whole (the buffer itself, not a copy) as soon as it reaches ``size``,
    so parts are ``size`` to ``size + len(chunk) - 1`` bytes; what is left at the end is
    :meth:`rest` (the last part, any size, possibly empty). ``size`` 0 never cuts.

    Args:
        size: Bytes per part (S3: at least 5 MiB but for the last).
    """

    def __init__(self, size: int):
        self.size = size
        self.buf = bytearray()

    def feed(self, chunk: bytes) -> bytearray | None:
        """Add ``chunk``; returns a full part once there is one, else None."""
        self.buf += chunk
        if self.size and len(self.buf) >= self.size:
            part, self.buf = self.buf, bytearray()
            return part
        return None

    def rest(self) -> bytearray:
        """The bytes not yet handed out as a part."""
        return self.buf


_ending: set[asyncio.Task] = set()  # StagedBody ends running on after their request was cancelled


@contextlib.contextmanager
def _s3_errors() -> Iterator[None]:
    try:
        yield
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - S3 (or the spool disk) failed: nothing was promised yet
        raise ApiError(503, "unavailable", f"the image could not be stored: {exc!r}") from None


class StagedBody:
    """A raw body or multipart file part of one S3 part or more, streamed while it is read: each part goes to an S3
    multipart upload to a new staging key (:meth:`ObjectStore.staging_key`) and to a spool file
    on local disk (an unlinked temporary file: gone when closed, or when the process dies), in
    the order read.

    At most one part is in flight while the next one fills, so a request holds at most about two
    parts in memory; :meth:`add` waits for the previous part first (the client is slowed down
    instead). Each part is given back to the request's :class:`Reservation` once sent.

    Whoever made it must call :meth:`discard` when the request ends, in every case: it aborts
    the multipart upload unless it was completed (by
    :func:`services.ingest.accept.accept_staged`) or already aborted, so no parts are left.

    Args:
        store: The object store.
        budget: The request's share of the upload budget (given back part by part), or None.
        on_end: Called once by :meth:`discard` with ``completed``, ``aborted`` or ``abort_failed``.
    """

    def __init__(self, store: ObjectStore, budget: Reservation | None = None,
                 on_end: Callable[[str], None] | None = None):
        self.store = store
        self.budget = budget
        self.on_end = on_end
        self.key = store.staging_key()
        self.upload: MultipartUpload | None = None
        self.spool = tempfile.TemporaryFile(prefix="ocrstream-upload-")
        self.size = 0
        self._inflight: asyncio.Task | None = None
        self._ended = False

    async def add(self, part: bytearray) -> None:
        """Send ``part`` (at least 5 MiB unless it is the last) in the background, after the
        previous part has been sent; starts the multipart upload with the first part.

        Raises:
            ApiError: 503 ``unavailable`` when S3 (or the spool disk) failed with this part or
                the previous one.
        """
        with _s3_errors():
            await self._wait_inflight()
            if self.upload is None:
                self.upload = await self.store.start_multipart(self.key)
            self.size += len(part)
            self._inflight = asyncio.ensure_future(self._send(self.upload, part))

    async def finish(self, rest: bytearray) -> None:
        """Send the last part (``rest``, any size; nothing if empty) and wait until every part is
        in S3 and in the spool file.

        Raises:
            ApiError: 503 ``unavailable`` as :meth:`add`.
        """
        if rest:
            await self.add(rest)
        with _s3_errors():
            await self._wait_inflight()
            await asyncio.to_thread(self.spool.flush)

    async def _send(self, upload: MultipartUpload, part: bytearray) -> None:
        try:
            results = await asyncio.gather(asyncio.to_thread(self.spool.write, part), upload.upload_part(part),
                                           return_exceptions=True)  # both ended before the part is let go
        finally:
            if self.budget is not None:
                self.budget.give(len(part))
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _wait_inflight(self) -> None:
        f = self._inflight
        if f is not None:
            await asyncio.shield(f)  # a cancelled caller leaves the part running: discard() waits for it
            self._inflight = None

    async def discard(self) -> None:
        """End the staged upload (idempotent): wait for a part still in flight, abort the multipart
        upload if it is still open, close (and so delete) the spool file. Runs to its end even
        if the calling request is cancelled. An abort that fails is logged and counted
        (``abort_failed``); the bucket's staging lifecycle rule removes those parts later."""
        if self._ended:
            return
        self._ended = True
        task = asyncio.ensure_future(self._discard())
        _ending.add(task)
        task.add_done_callback(_ending.discard)
        await asyncio.shield(task)

    async def _discard(self) -> None:
        outcome = "aborted"
        try:
            if self._inflight is not None:
                with contextlib.suppress(BaseException):
                    await self._inflight
            if self.upload is not None and self.upload.state == "completed":
                outcome = "completed"
            elif self.upload is not None:
                try:
                    await self.upload.abort()
                except Exception as exc:  # noqa: BLE001 - left to the lifecycle rule
                    outcome = "abort_failed"
                    log.warning("api: multipart upload %s to %s not aborted: %r", self.upload.upload_id, self.key, exc)
        finally:
            self.spool.close()
            if self.on_end is not None:
                self.on_end(outcome)


async def read_raw(request: Request, limit: int, budget: Reservation | None = None,
                   timeout_s: float | None = None, *, store: ObjectStore | None = None, part_bytes: int = 0,
                   on_staged_end: Callable[[str], None] | None = None) -> Upload:
    """A raw-body upload (``Content-Type: image/*``, ``application/pdf`` or
    ``application/octet-stream``), hashed chunk by chunk as it is read.

    A body under ``part_bytes`` is returned in memory (``Upload.data``). Once a body reaches
    ``part_bytes`` (and ``store`` is given) it is streamed while it is read: a
    :class:`StagedBody` in ``Upload.staged``, whose :meth:`StagedBody.discard` the caller must
    call when the request ends. If reading fails (413, 408, 503, the client going away), the
    staged upload is discarded here before the error is raised.

    Args:
        limit: Bytes; 413 past it.
        budget: The request's share of the upload budget.
        timeout_s: The whole body must arrive within this many seconds.
        store: Where a large body is streamed; None keeps every body in memory.
        part_bytes: S3 part size, bytes (>= 5 MiB); 0 keeps every body in memory.
        on_staged_end: Passed to :class:`StagedBody` (the outcome of a streamed upload).

    Raises:
        ApiError: 413 ``input_too_large``; 400 ``empty_input`` for an empty body; 408, 503 as
            :func:`limited_stream`; 503 ``unavailable`` when S3 fails during a streamed upload.
    """
    h = hashlib.sha256()
    parts = PartSplitter(part_bytes if store is not None else 0)
    staged: StagedBody | None = None
    try:
        async for chunk in limited_stream(request, limit, budget, timeout_s):
            h.update(chunk)
            part = parts.feed(chunk)
            if part is not None:
                if staged is None:
                    staged = StagedBody(store, budget, on_staged_end)
                await staged.add(part)
        if staged is not None:
            await staged.finish(parts.rest())
    except BaseException:
        if staged is not None:
            await staged.discard()
        raise
    if staged is not None:
        return Upload(b"", h.hexdigest(), None, staged)
    buf = parts.rest()
    if not buf:
        raise ApiError(400, "empty_input", "the request body is empty")
    return Upload(bytes(buf), h.hexdigest(), None)
