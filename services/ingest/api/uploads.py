"""Reading uploads with the byte limit enforced while reading, and hashing as the bytes arrive."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from services.ingest.api.errors import ApiError

#: Room for multipart boundaries, part headers and option fields on top of the image bytes.
MULTIPART_OVERHEAD = 64 * 1024


@dataclass(frozen=True)
class Upload:
    """One uploaded image: its bytes, SHA-256 (hex, computed while reading when possible),
    the client's file name and the form's option fields (multipart only)."""

    data: bytes
    sha256: str
    filename: str | None


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
    """One request's share of an :class:`UploadBudget`."""

    def __init__(self, budget: UploadBudget):
        self.budget = budget
        self.held = 0

    def take(self, n: int) -> None:
        """Charge ``n`` bytes.

        Raises:
            ApiError: 503 ``overloaded`` when the process already holds its budget.
        """
        b = self.budget
        if b.limit and b.used + n > b.limit:
            raise ApiError(503, "overloaded", f"uploads in progress already hold {b.used} bytes (limit {b.limit}); retry shortly",
                           {"Retry-After": "1"})
        b.used += n
        self.held += n

    def release(self) -> None:
        """Give back everything this request took (idempotent)."""
        self.budget.used -= self.held
        self.held = 0


def _too_large(limit: int) -> ApiError:
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
        raise _too_large(limit)


async def limited_stream(request: Request, limit: int, budget: Reservation | None = None,
                         timeout_s: float | None = None) -> AsyncIterator[bytes]:
    """The request body in chunks as they arrive, stopping with 413 as soon as more than
    ``limit`` bytes came (chunked uploads have no Content-Length to check up front).

    Args:
        timeout_s: The whole body must arrive within this many seconds (None = no limit), so a
            client trickling bytes (slowloris) cannot hold a connection and its budget forever.

    Raises:
        ApiError: 413 ``input_too_large``; 503 ``overloaded`` when ``budget`` runs out; 408
            ``request_timeout`` when the body is not complete within ``timeout_s``.
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
        seen += len(chunk)
        if seen > limit:
            raise _too_large(limit)
        if budget is not None:
            budget.take(len(chunk))
        yield chunk


async def read_raw(request: Request, limit: int, budget: Reservation | None = None,
                   timeout_s: float | None = None) -> Upload:
    """A raw-body upload (``Content-Type: image/*``, ``application/pdf`` or
    ``application/octet-stream``), hashed chunk by chunk as it is read.

    Raises:
        ApiError: 413 ``input_too_large``; 400 ``empty_input`` for an empty body.
    """
    h = hashlib.sha256()
    buf = bytearray()
    async for chunk in limited_stream(request, limit, budget, timeout_s):
        h.update(chunk)
        buf += chunk
    if not buf:
        raise ApiError(400, "empty_input", "the request body is empty")
    return Upload(bytes(buf), h.hexdigest(), None)


async def read_multipart(request: Request, image_limit: int, total_limit: int, max_files: int,
                         budget: Reservation | None = None, timeout_s: float | None = None
                         ) -> tuple[list[Upload], dict[str, str]]:
    """A ``multipart/form-data`` upload: the file parts (any field name, in order) and the
    text fields (options such as ``task``, ``callback_url``).

    Args:
        image_limit: Bytes per file.
        total_limit: Bytes of the whole body, enforced while reading.
        max_files: File parts accepted.

    Raises:
        ApiError: 413 ``input_too_large`` (body or one file over its limit), 400
            ``invalid_request`` (malformed multipart, too many files or fields), 400
            ``empty_input`` (no file part, or an empty one).
    """
    parser = MultiPartParser(request.headers, limited_stream(request, total_limit, budget, timeout_s),
                             max_files=max_files, max_fields=32, max_part_size=64 * 1024)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise ApiError(400, "invalid_request", f"multipart body rejected: {exc.message}") from None
    uploads: list[Upload] = []
    fields: dict[str, str] = {}
    try:
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                data = await value.read()
                if len(data) > image_limit:
                    raise _too_large(image_limit)
                if not data:
                    raise ApiError(400, "empty_input", f"file part {value.filename or name!r} is empty")
                uploads.append(Upload(data, hashlib.sha256(data).hexdigest(), value.filename))
            else:
                fields[name] = value
    finally:
        await form.close()
    if not uploads:
        raise ApiError(400, "empty_input", "the multipart body has no file part")
    return uploads, fields
