"""Reading uploads with the byte limit enforced while reading, and hashing as the bytes arrive;
a raw body larger than one S3 part is streamed to S3 (and a spool file) while it is read.
``multipart/form-data`` bodies are read by :mod:`services.api.forms`, which streams
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
from services.api.errors import ApiError

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
    """Bytes of request bodies held in memory at once by this process, across the requests
    charged to it.

    Each request takes a :class:`Reservation`, charged chunk by chunk as its body arrives (never
    by what its headers declare) and released when the request ends; a chunk that would pass the
    budget fails the request with 503 ``overloaded`` (and ``Retry-After``) instead of letting
    many large uploads exhaust memory.

    Args:
        limit: Bytes; 0 = unbounded.
        name: How the budget is named in messages and metrics (``uploads``, ``small``).
    """

    def __init__(self, limit: int, name: str = "uploads"):
        self.limit = limit
        self.name = name
        self.used = 0

    def fits(self, n: int) -> bool:
        """Whether ``n`` more bytes fit in the budget now."""
        return not self.limit or self.used + n <= self.limit

    def full(self) -> ApiError:
        """503 ``overloaded``: the budget cannot take more now."""
        return ApiError("overloaded", f"uploads in progress already hold {self.used} bytes of the "
                        f"{self.name} budget (limit {self.limit}); retry shortly", {"Retry-After": "1"})

    def reservation(self, on_release: Callable[[], None] | None = None) -> "Reservation":
        """A per-request account; call :meth:`Reservation.release` when the request ends.

        Args:
            on_release: Called once by the first :meth:`Reservation.release` (frees the
                request's upload slots: :class:`UploadGate`).
        """
        return Reservation(self, on_release)


class Reservation:
    """One request's share of an :class:`UploadBudget`: ``held`` = the bytes of its body in
    memory now (charged by :meth:`take` as they arrive, given back by :meth:`give` as parts go
    to S3). A declared ``Content-Length`` never holds anything: 32 slow clients announcing large
    bodies hold only the bytes they actually sent.
    """

    def __init__(self, budget: UploadBudget, on_release: Callable[[], None] | None = None):
        self.budget = budget
        self.held = 0
        self._on_release = on_release

    @property
    def in_memory(self) -> int:
        """Bytes of the body in memory now (what is charged: ``held``)."""
        return self.held

    def admit(self, n: int) -> None:
        """Check, before the body is read, that ``n`` bytes (what the body is expected to hold,
        :func:`expected_hold`) fit in the budget now, at most the whole budget (a request is
        never refused by an idle budget). Nothing is set aside: the body is charged as it arrives.

        Raises:
            ApiError: 503 ``overloaded`` when they do not fit now.
        """
        b = self.budget
        if b.limit and not b.fits(min(n, b.limit) - self.held):
            raise b.full()

    def take(self, n: int) -> None:
        """``n`` more bytes of the body are in memory.

        Raises:
            ApiError: 503 ``overloaded`` when they do not fit in the budget.
        """
        b = self.budget
        if not b.fits(n):
            raise b.full()
        b.used += n
        self.held += n

    def give(self, n: int) -> None:
        """``n`` bytes left memory (a part sent to S3): given back, never below zero."""
        n = min(n, self.held)
        self.held -= n
        self.budget.used -= n

    def release(self) -> None:
        """Give back everything this request holds, and its upload slots (idempotent)."""
        self.budget.used -= self.held
        self.held = 0
        cb, self._on_release = self._on_release, None
        if cb is not None:
            cb()


def declared_length(request: Request) -> int | None:
    """The body's ``Content-Length``, or None when absent or malformed (chunked bodies have none)."""
    raw = request.headers.get("content-length")
    if raw is None or not raw.isdigit():
        return None
    return int(raw)


class UploadGate:
    """Admission of request bodies at the door: which budget a body is charged to, and how many
    uploads each client address and each API key may have charged to the upload budget at once.

    * A body that declares a ``Content-Length`` of at most ``small_body_bytes`` is charged to
      the small-body budget (``small_limit`` bytes) while that has room for it, so small uploads
      (cached images among them: the door cannot know an image is cached before its bytes are
      in) are never refused because large uploads hold the upload budget. Every other body (and
      a small one when the small-body budget is full) is charged to the upload budget (``limit``).
    * Bodies charged to the upload budget take a slot of their client address
      (``request.client``: the peer, or the ``X-Forwarded-For`` address when the peer is a
      trusted proxy, ``OCRSTREAM_HTTP_FORWARDED_ALLOW_IPS``) and of their API key: at most
      ``per_client`` / ``per_key`` at once (0 = no limit); past it 429 ``too_many_uploads``
      with ``Retry-After: 1`` before a byte of the body is read. 429, not 503: the caller
      itself holds the slots, and its own uploads ending frees them whatever the door's load
      (RFC 6585 §4). Small bodies take no slot: a client may send many cached images at once.

    Args:
        limit: The upload budget, bytes (0 = unbounded).
        small_limit: The small-body budget, bytes (0 = none: every body is charged to the upload budget).
        small_body_bytes: Largest declared body charged to the small-body budget, bytes.
        per_client: Uploads charged to the upload budget at once per client address (0 = no limit).
        per_key: Uploads charged to the upload budget at once per API key (0 = no limit).
    """

    def __init__(self, limit: int, small_limit: int = 0, small_body_bytes: int = 0, per_client: int = 0,
                 per_key: int = 0):
        self.budget = UploadBudget(limit, "uploads")
        self.small = UploadBudget(small_limit, "small-body") if small_limit > 0 else None
        self.small_body_bytes = small_body_bytes
        self.per_client = per_client
        self.per_key = per_key
        self.by_client: dict[str, int] = {}
        self.by_key: dict[str, int] = {}
        self.open_uploads = 0  # bodies being read or held, both budgets

    def open(self, request: Request, key_id: str | None, expected: int) -> Reservation:
        """Admit one upload: choose its budget, take its slots (upload budget only), and check the
        budget has room for ``expected`` bytes now (checked, not set aside:
        :meth:`Reservation.admit`). Release the returned reservation when the request ends
        (that also frees its slots).

        Args:
            request: The request (its client address and ``Content-Length``).
            key_id: The caller's API key id; None with keys off (then per client address only).
            expected: What the body is expected to hold in memory, bytes (:func:`expected_hold`).

        Raises:
            ApiError: 429 ``too_many_uploads`` (with ``Retry-After``) when the key or the client
                address already has its uploads in progress; 503 ``overloaded`` when the budget
                has no room for ``expected`` now.
        """
        declared = declared_length(request)
        if (self.small is not None and declared is not None and declared <= self.small_body_bytes
                and self.small.fits(expected)):
            held = Reservation(self.small)
            self.open_uploads += 1
            held._on_release = self._close_small
            return held
        client = request.client.host if request.client is not None else None
        if self.per_key and key_id is not None and self.by_key.get(key_id, 0) >= self.per_key:
            raise ApiError("too_many_uploads", f"API key {key_id} already has {self.per_key} uploads in progress "
                           f"(OCRSTREAM_HTTP_UPLOADS_PER_KEY); retry once one has ended", {"Retry-After": "1"})
        if self.per_client and client and self.by_client.get(client, 0) >= self.per_client:
            raise ApiError("too_many_uploads", f"client {client} already has {self.per_client} uploads in progress "
                           f"(OCRSTREAM_HTTP_UPLOADS_PER_CLIENT); retry once one has ended", {"Retry-After": "1"})
        held = Reservation(self.budget)
        held.admit(expected)
        self.open_uploads += 1
        if key_id is not None:
            self.by_key[key_id] = self.by_key.get(key_id, 0) + 1
        if client:
            self.by_client[client] = self.by_client.get(client, 0) + 1
        held._on_release = lambda: self._close(client, key_id)
        return held

    def _close_small(self) -> None:
        self.open_uploads -= 1

    def _close(self, client: str | None, key_id: str | None) -> None:
        self.open_uploads -= 1
        for counts, k in ((self.by_key, key_id), (self.by_client, client)):
            if k:
                n = counts.get(k, 0) - 1
                if n > 0:
                    counts[k] = n
                else:
                    counts.pop(k, None)

    def held(self) -> int:
        """Bytes held by uploads in progress, both budgets."""
        return self.budget.used + (self.small.used if self.small is not None else 0)


@dataclass(frozen=True)
class BodyPace:
    """How fast a request body must arrive, checked as it is read (a reverse proxy's body
    timeouts: nginx's ``client_body_timeout`` is the time between two successive reads, Apache
    mod_reqtimeout's ``body=...,MinRate=`` a deadline extended by each byte received).

    The next chunk must arrive before the earliest of:

    * ``idle_s`` after the door asked for it (a body that stalls);
    * ``grace_s + received / min_rate`` of reading (the body's average rate, the door's own
      waits left out, fell under ``min_rate`` bytes/s after the grace period);
    * ``total_s`` of waiting for the body in all (the whole body).

    Time the door spends between chunks (sending a part to S3 while the client is held back)
    counts against none of them. None / 0 turns a bound off.

    Attributes:
        total_s: Whole body, s.
        idle_s: Longest wait for one chunk, s.
        min_rate: Bytes/s the body must average after ``grace_s``; 0 = no minimum.
        grace_s: Seconds before the minimum rate applies.
    """

    total_s: float | None = None
    idle_s: float | None = None
    min_rate: float = 0.0
    grace_s: float = 0.0

    def deadline(self, waited: float, now: float, received: int) -> tuple[float | None, str]:
        """The loop time the next chunk must arrive by (None: no bound), and the 408 message if it
        does not.

        Args:
            waited: Seconds spent waiting for chunks so far (the door's own time left out).
            now: Loop time the door starts waiting for this chunk.
            received: Body bytes received so far.
        """
        best: tuple[float | None, str] = (None, "")
        if self.total_s is not None:
            best = (now + self.total_s - waited, f"the body did not arrive within {self.total_s:g} s")
        if self.idle_s is not None and (best[0] is None or now + self.idle_s < best[0]):
            best = (now + self.idle_s, f"no byte of the body came for {self.idle_s:g} s")
        if self.min_rate > 0:
            t = now + self.grace_s + received / self.min_rate - waited
            if best[0] is None or t < best[0]:
                best = (t, f"the body came slower than {self.min_rate:g} bytes/s on average "
                           f"(after a grace of {self.grace_s:g} s): {received} bytes so far")
        return best


#: Room for what a streamed body holds besides its two parts (the chunks being read), bytes.
STREAM_SLACK = 256 * 1024


def expected_hold(request: Request, limit: int, part_bytes: int = 0) -> int:
    """The most a request's body will hold in memory, from its ``Content-Length``: the whole
    body, or for a body that will stream to S3 (``part_bytes`` > 0 and the body at least one
    part: a raw body, or a multipart body with one file part) about two parts
    (:class:`StagedBody`). Without a length (``Transfer-Encoding: chunked``) and ``part_bytes``
    > 0, the most any such body can hold, ``min(limit, 2 * part_bytes + STREAM_SLACK)``. Checked
    at admission (:meth:`Reservation.admit`: a body that would not fit now is refused before it
    is read), never set aside: only the bytes that arrive are charged. 0 when the
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
    return ApiError("input_too_large", f"the upload exceeds the limit of {limit} bytes")


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
        raise ApiError("invalid_request", "Content-Length is not a number") from None
    if n > limit:
        raise too_large(limit)


async def limited_stream(request: Request, limit: int, budget: Reservation | None = None,
                         timeout_s: float | BodyPace | None = None) -> AsyncIterator[bytes]:
    """The request body in chunks as they arrive, stopping with 413 as soon as more than
    ``limit`` bytes came (chunked uploads have no Content-Length to check up front).

    Args:
        timeout_s: How fast the body must come (:class:`BodyPace`); a number is the whole
            body's limit in seconds; None = no limit. A client trickling bytes (slowloris)
            cannot hold a connection and its budget for long.

    Raises:
        ApiError: 413 ``input_too_large``; 503 ``overloaded`` when ``budget`` runs out; 408
            ``request_timeout`` when the body is too slow (the message says which bound); 499
            ``client_closed`` when the client went away first (nginx's status: no one reads it).
    """
    check_declared_length(request, limit)
    pace = timeout_s if isinstance(timeout_s, BodyPace) or timeout_s is None else BodyPace(total_s=timeout_s)
    seen = 0
    loop = asyncio.get_running_loop()
    waited = 0.0  # seconds spent waiting for the client, the door's own work between chunks left out
    chunks = request.stream().__aiter__()
    while True:
        now = loop.time()
        deadline, why = pace.deadline(waited, now, seen) if pace is not None else (None, "")
        try:
            if deadline is None:
                chunk = await chunks.__anext__()
            else:
                async with asyncio.timeout_at(deadline):  # no task per chunk, unlike wait_for
                    chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise ApiError("request_timeout", why) from None
        except ClientDisconnect:  # not a server error: counted, no traceback logged, nothing answered
            raise ApiError("client_closed", "the client closed the connection before the body was complete") from None
        waited += loop.time() - now
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
        raise ApiError("unavailable", f"the image could not be stored: {exc!r}") from None


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
    :func:`services.common.images.accept.accept_staged`) or already aborted, so no parts are left.

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
                   timeout_s: float | BodyPace | None = None, *, store: ObjectStore | None = None, part_bytes: int = 0,
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
        timeout_s: How fast the body must come (:class:`BodyPace`, or the whole body's seconds).
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
        raise ApiError("empty_input", "the request body is empty")
    return Upload(bytes(buf), h.hexdigest(), None)
