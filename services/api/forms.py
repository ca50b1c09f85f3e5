"""Reading a ``multipart/form-data`` upload as a stream: each file part hashed and held to its
byte limit while it arrives, and a large one sent to S3 (and a spool file) while it is read.

The body is cut into parts by python-multipart's ``MultipartParser`` (the parser Starlette's
form parser drives; the format is RFC 7578, "Returning Values from Forms: multipart/form-data").
Its callbacks are synchronous, so :class:`FormReader` does what needs no waiting (hashing,
limits, option fields) inside them and queues the S3 parts, which :func:`read_multipart` sends
after each chunk: the same :class:`~services.api.uploads.PartSplitter` and
:class:`~services.api.uploads.StagedBody` path as a raw body (:func:`read_raw`).
"""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Callable

from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header
from starlette.requests import Request

from schemas.tasks import MAX_FIELDS as TASK_MAX_FIELDS
from services.common.s3 import ObjectStore
from services.api.errors import ApiError
from services.api.protocol import repeated_fields
from services.api.uploads import (
    BodyPace, PartSplitter, Reservation, StagedBody, Upload, limited_stream, too_large,
)

#: Option fields accepted per body, and bytes per option field (as Starlette's parser was set).
MAX_FIELDS = 32
MAX_FIELD_BYTES = 64 * 1024


def _rejected(why: str) -> ApiError:
    return ApiError("invalid_request", f"multipart body rejected: {why}")


def _decode(raw: bytes, charset: str) -> str:
    """Field names, values and file names in the body's charset; latin-1 when they are not
    (Starlette's ``_user_safe_decode``: never an error for odd bytes)."""
    try:
        return raw.decode(charset)
    except (UnicodeDecodeError, LookupError):
        return raw.decode("latin-1")


class FilePart:
    """One file part while it is read: its SHA-256 and length so far, the bytes not yet sent
    (:class:`PartSplitter`), and its :class:`StagedBody` once it reached one S3 part."""

    def __init__(self, name: str, filename: str, part_bytes: int):
        self.name = name
        self.filename = filename
        self.hash = hashlib.sha256()
        self.size = 0
        self.parts = PartSplitter(part_bytes)
        self.staged: StagedBody | None = None
        self.ended = False


class FormReader:
    """The callbacks of one ``MultipartParser``: collects the option fields, and for each file
    part checks and hashes its bytes as they come and queues them for :func:`read_multipart`.

    No I/O happens here. :attr:`ready` lists, in body order, ``(file, part)`` for each full S3
    part cut from a file (``part`` a bytearray of ``part_bytes`` or more) and ``(file, None)``
    when a file part has ended; the caller empties it after each chunk.

    Args:
        charset: Of field names, values and file names (the body's ``charset`` parameter).
        image_limit: Bytes per file part; 413 as soon as a part passes it.
        max_files: File parts accepted; 400 past it.
        part_bytes: Size of the S3 parts a file part is cut into; 0 keeps every file in memory.
        max_fields: Option fields accepted; 400 past it.
        max_field_bytes: Bytes per option field; 400 past it.

    Raises (from the callbacks, so from ``MultipartParser.write``):
        ApiError: 413 ``input_too_large``; 400 ``invalid_request`` (a part without a field name,
            too many files or fields, a field too long); 400 ``empty_input`` (an empty file part).
    """

    def __init__(self, charset: str, image_limit: int, max_files: int, part_bytes: int = 0,
                 max_fields: int = MAX_FIELDS, max_field_bytes: int = MAX_FIELD_BYTES):
        self.charset = charset
        self.image_limit = image_limit
        self.max_files = max_files
        self.part_bytes = part_bytes
        self.max_fields = max_fields
        self.max_field_bytes = max_field_bytes
        self.fields: dict[str, str] = {}
        self._field_list: list[str] = []  # the values of a repeated ``fields`` (extract's field names)
        self.files: list[FilePart] = []
        self.ready: list[tuple[FilePart, bytearray | None]] = []
        self._n_fields = 0
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._disposition = b""
        self._file: FilePart | None = None
        self._field_name = ""
        self._field = bytearray()

    def callbacks(self) -> dict[str, Callable]:
        """The callbacks dict ``MultipartParser`` takes."""
        return {"on_part_begin": self.on_part_begin, "on_part_data": self.on_part_data,
                "on_part_end": self.on_part_end, "on_header_field": self.on_header_field,
                "on_header_value": self.on_header_value, "on_header_end": self.on_header_end,
                "on_headers_finished": self.on_headers_finished}

    def on_part_begin(self) -> None:
        self._disposition = b""
        self._file = None
        self._field = bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise _rejected('The Content-Disposition header field "name" must be provided.')
        name = _decode(options[b"name"], self.charset)
        if b"filename" in options:
            if len(self.files) >= self.max_files:
                raise _rejected(f"Too many files. Maximum number of files is {self.max_files}.")
            self._file = FilePart(name, _decode(options[b"filename"], self.charset), self.part_bytes)
            self.files.append(self._file)
        elif name == "fields" and len(self._field_list) <= TASK_MAX_FIELDS:
            self._field_name = name  # extract's field names, one part each: bounded by the task (50, one more
            # to be told so by the task's check), not by the form's other fields
        else:
            self._n_fields += 1
            if self._n_fields > self.max_fields:
                raise _rejected(f"Too many fields. Maximum number of fields is {self.max_fields}.")
            self._field_name = name

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        f = self._file
        if f is None:
            if len(self._field) + end - start > self.max_field_bytes:
                raise _rejected(f"Part exceeded maximum size of {self.max_field_bytes // 1024}KB.")
            self._field += data[start:end]
            return
        f.size += end - start
        if f.size > self.image_limit:
            raise too_large(self.image_limit)
        view = memoryview(data)[start:end]  # no copy until the splitter's buffer
        f.hash.update(view)
        part = f.parts.feed(view)
        if part is not None:
            self.ready.append((f, part))

    def on_part_end(self) -> None:
        f = self._file
        if f is None:
            value = _decode(bytes(self._field), self.charset)
            if self._field_name == "fields":  # repeated once per field name: one JSON list of them
                self._field_list.append(value)
                value = repeated_fields(self._field_list)
            self.fields[self._field_name] = value
            return
        if not f.size:
            raise ApiError("empty_input", f"file part {f.filename or f.name!r} is empty")
        f.ended = True
        self.ready.append((f, None))


async def read_multipart(request: Request, image_limit: int, total_limit: int, max_files: int,
                         budget: Reservation | None = None, timeout_s: float | BodyPace | None = None, *,
                         store: ObjectStore | None = None, part_bytes: int = 0,
                         on_staged_end: Callable[[str], None] | None = None
                         ) -> tuple[list[Upload], dict[str, str]]:
    """A ``multipart/form-data`` upload, parsed while it is read: the file parts (any field name,
    in body order) and the option fields (such as ``task``, ``callback_url``; anywhere in the body).

    Each file part is hashed and held to ``image_limit`` as its bytes arrive. A file part under
    ``part_bytes`` is returned in memory (``Upload.data``); once one reaches ``part_bytes`` (and
    ``store`` is given) it is streamed while it is read, as :func:`read_raw` streams a raw body:
    a :class:`StagedBody` in ``Upload.staged``, one part in flight at a time. The caller must
    call :meth:`StagedBody.discard` on every returned upload's ``staged`` when the request ends;
    if reading fails, every staged upload of the body is discarded here before the error is raised.

    Args:
        image_limit: Bytes per file part.
        total_limit: Bytes of the whole body, enforced while reading.
        max_files: File parts accepted.
        budget: The request's share of the upload budget (chunks charged as read, S3 parts given back).
        timeout_s: How fast the body must come (:class:`~services.api.uploads.BodyPace`, or
            the whole body's seconds).
        store: Where large file parts are streamed; None keeps every file in memory.
        part_bytes: S3 part size, bytes (>= 5 MiB); 0 keeps every file in memory.
        on_staged_end: Passed to :class:`StagedBody` (the outcome of a streamed file).

    Raises:
        ApiError: 413 ``input_too_large`` (body or one file part over its limit, as soon as it
            passes it); 400 ``invalid_request`` (malformed multipart, no boundary, too many
            files or fields, the only file part cut off by the end of the body); 400 ``empty_input`` (no file part, or an empty one); 408, 499, 503
            as :func:`limited_stream`; 503 ``unavailable`` when S3 fails during a streamed file.
    """
    _, params = parse_options_header(request.headers.get("content-type", ""))
    charset = params.get(b"charset", b"utf-8").decode("latin-1")
    try:
        charset = codecs.lookup(charset).name
    except LookupError:
        charset = "latin-1"
    if b"boundary" not in params:
        raise _rejected("Missing boundary in multipart.")
    form = FormReader(charset, image_limit, max_files, part_bytes if store is not None else 0)
    try:
        parser = MultipartParser(params[b"boundary"], form.callbacks())
    except FormParserError as exc:  # e.g. a boundary python-multipart refuses (over 256 characters)
        raise _rejected(str(exc)) from None
    try:
        async for chunk in limited_stream(request, total_limit, budget, timeout_s):
            try:
                parser.write(chunk)
            except FormParserError:
                raise _rejected("Invalid multipart data.") from None
            await _send_ready(form, store, budget, on_staged_end)
        await _send_ready(form, store, budget, on_staged_end)
    except BaseException:
        for f in form.files:
            if f.staged is not None:
                await f.staged.discard()
        raise
    uploads: list[Upload] = []
    cut = 0
    for f in form.files:
        if not f.ended:  # cut off by the end of the body: ignored, as Starlette's parser does
            cut += 1
            if f.staged is not None:
                await f.staged.discard()
            continue
        if f.staged is not None:
            uploads.append(Upload(b"", f.hash.hexdigest(), f.filename, f.staged))
        else:
            uploads.append(Upload(bytes(f.parts.rest()), f.hash.hexdigest(), f.filename))
    if not uploads and cut:
        raise _rejected("its file part is cut off by the end of the body (no closing boundary)")
    if not uploads:
        raise ApiError("empty_input", "the multipart body has no file part")
    return uploads, form.fields


async def _send_ready(form: FormReader, store: ObjectStore | None, budget: Reservation | None,
                      on_staged_end: Callable[[str], None] | None) -> None:
    """Send the S3 parts the parser cut since the last call, and finish the files that ended."""
    ready, form.ready = form.ready, []
    for f, part in ready:
        if part is not None:
            if f.staged is None:
                f.staged = StagedBody(store, budget, on_staged_end)
            await f.staged.add(part)
        elif f.staged is not None:
            await f.staged.finish(f.parts.rest())
            f.parts.buf = bytearray()
