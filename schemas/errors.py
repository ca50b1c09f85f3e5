"""Every error code a user can see, from any door, with its HTTP status and its meaning: one table.

Two enums name the codes: :class:`ErrorCode`, the codes a request can *end* with (a result's
``error.code``: on ``ocr.results`` and ``ocr.completed``, in MariaDB, in ``GET /v1/ocr/{id}`` and
in webhooks; part of the event schema), and :class:`HttpErrorCode`, the HTTP door's own answers
(``unauthorized``, ``rate_limited``, ...) that never end a request. :data:`ERRORS` gives each code
of both its HTTP status (the one place statuses are mapped: the door's ``ApiError`` looks its
status up here) and its meaning; ``docs/errors.md`` is generated from it
(``python scripts/errors_table.py --write docs/errors.md``).

Codes are stable API: new codes may be added, existing ones never change meaning. A new code goes
at the END of its enum and gets its row in :data:`ERRORS` (``tests/unit/test_errors_table.py``
fails when a code has none); then regenerate ``docs/errors.md`` and ``python -m schemas.generate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class OcrstreamError(Exception):
    """The root of ocrstream's own exceptions: every exception class of ``schemas/`` and
    ``services/`` derives from it (``services.common.errors`` re-exports it).

    ``retriable`` (a class attribute, or set per instance), as aiokafka's ``KafkaError.retriable``:
    True when the failure may pass by itself (a store, the broker or a model server down), so the
    runner retries with backoff for as long as it lasts; False when retrying the same input cannot
    help (bad input, a bug), so it is tried a bounded number of times, then given up on.
    """

    retriable: bool = False


class ErrorCode(str, Enum):
    """Why a request ended with status ``error``.

    Codes are stable API: new codes may be added, existing ones never change meaning. Their
    meanings and HTTP statuses: the error table (``docs/errors.md``).
    """

    EMPTY_INPUT = "empty_input"
    INPUT_TOO_LARGE = "input_too_large"
    UNSUPPORTED_FORMAT = "unsupported_format"
    CORRUPT_IMAGE = "corrupt_image"
    IMAGE_TOO_LARGE = "image_too_large"
    TOO_MANY_PAGES = "too_many_pages"
    MISSING_OBJECT = "missing_object"
    INVALID_REQUEST = "invalid_request"
    TIMEOUT = "timeout"
    ENGINE_ERROR = "engine_error"
    INTERNAL_ERROR = "internal_error"
    ENGINE_CRASH = "engine_crash"
    DECODE_TIMEOUT = "decode_timeout"
    IMAGE_TOO_COMPLEX = "image_too_complex"
    REQUEST_ID_CONFLICT = "request_id_conflict"
    IMAGE_URI_NOT_ALLOWED = "image_uri_not_allowed"
    STAGE_CRASH = "stage_crash"
    UNSUPPORTED_TASK = "unsupported_task"
    UNPARSABLE_OUTPUT = "unparsable_output"
    DOCUMENT_TOO_MANY_PAGES = "document_too_many_pages"
    DOCUMENT_TOO_LARGE = "document_too_large"
    DOCUMENT_PAGES_FAILED = "document_pages_failed"
    HTTP_DOOR_UNVERIFIED = "http_door_unverified"


class HttpErrorCode(str, Enum):
    """The HTTP door's own error codes: answers to a call, never the end of a request (meanings: :data:`ERRORS`)."""

    UNAUTHORIZED = "unauthorized"
    RATE_LIMITED = "rate_limited"
    QUOTA_EXCEEDED = "quota_exceeded"
    TOO_MANY_UPLOADS = "too_many_uploads"
    NOT_FOUND = "not_found"
    REQUEST_TIMEOUT = "request_timeout"
    CALLBACK_NOT_ALLOWED = "callback_not_allowed"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CLIENT_CLOSED = "client_closed"
    HTTP_ERROR = "http_error"
    JOB_EXPECTED_TOO_SMALL = "job_expected_too_small"


@dataclass(frozen=True)
class ErrorSpec:
    """One row of the error table.

    Attributes:
        code: The code (a member of :class:`ErrorCode` or :class:`HttpErrorCode`).
        http_status: The status the HTTP door answers it with; None when it never is an HTTP
            answer's status (it only ends a request: ``GET /v1/ocr/{id}`` then answers 200 with
            ``status: error``), or for ``http_error``, which keeps the framework's own status.
        meaning: What happened and what to do, for users (markdown).
    """

    code: ErrorCode | HttpErrorCode
    http_status: int | None
    meaning: str

    @property
    def ends_request(self) -> bool:
        """Whether a request can end with it (a result's ``error.code``), as opposed to an HTTP answer only."""
        return isinstance(self.code, ErrorCode)


_E, _H = ErrorCode, HttpErrorCode
_ROWS = (
    ErrorSpec(_E.EMPTY_INPUT, 400, "The image had zero bytes (an empty body, an empty file part, a multipart body "
              "with no file part)."),
    ErrorSpec(_E.INPUT_TOO_LARGE, 413, "The upload exceeded the byte limit (`OCRSTREAM_LIMITS__MAX_IMAGE_BYTES`; a "
              "batch body: `OCRSTREAM_HTTP_BATCH_MAX_BYTES`); the HTTP door answers before reading the body when "
              "`Content-Length` is over it."),
    ErrorSpec(_E.UNSUPPORTED_FORMAT, 415, "The bytes are not an image format the pipeline reads (sniffed from the "
              "content, never the name), or the HTTP body's `Content-Type` is neither an image, a PDF, "
              "`application/octet-stream` nor `multipart/form-data`. The message lists the formats read: PNG, "
              "JPEG, GIF, TIFF, BMP, WebP, PBM/PGM/PPM, JPEG 2000, AVIF or PDF."),
    ErrorSpec(_E.CORRUPT_IMAGE, 422, "The format was recognised but the image data could not be decoded (e.g. "
              "truncated)."),
    ErrorSpec(_E.IMAGE_TOO_LARGE, 413, "Width x height exceeded `OCRSTREAM_LIMITS__MAX_PIXELS` (checked from the "
              "header, before decoding)."),
    ErrorSpec(_E.TOO_MANY_PAGES, 413, "A multi-page input (TIFF, GIF, PDF) had more pages than "
              "`OCRSTREAM_LIMITS__MAX_PAGES`."),
    ErrorSpec(_E.MISSING_OBJECT, None, "The referenced S3 object does not exist."),
    ErrorSpec(_E.INVALID_REQUEST, 400, "The submission could not be parsed or failed its schema: on the Kafka door "
              "the submit event, on the HTTP door an option or parameter (the message names it; e.g. a `task` "
              "not in `OCRSTREAM_TASKS`, a `callback_url` while webhooks are disabled, a `request_id` on a batch, "
              "a query parameter the route does not take, a number over its bound)."),
    ErrorSpec(_E.TIMEOUT, None, "The request's inference took longer than `OCRSTREAM_LIMITS__INFER_TIMEOUT_S` in "
              "all (one limit per request, over all its pages and tiles together), or one HTTP attempt of the "
              "`openai` engine got no answer within `OCRSTREAM_OPENAI_TIMEOUT_S` (the message says which)."),
    ErrorSpec(_E.ENGINE_ERROR, None, "The OCR engine raised on this image."),
    ErrorSpec(_E.INTERNAL_ERROR, 500, "A bug or an unexpected failure after bounded retries; the message says more "
              "(as an HTTP answer: an unhandled exception, whose traceback is in the door's log)."),
    ErrorSpec(_E.ENGINE_CRASH, None, "The OCR engine (its server) went away while it read this image alone, "
              "`OCRSTREAM_ENGINE_CRASH_LIMIT` times (a connection carrying it dropped, the retry refused): the "
              "image is not retried (the same bytes would take it down again)."),
    ErrorSpec(_E.DECODE_TIMEOUT, 422, "Decoding or rendering the image took longer than its wall-clock limit: one "
              "page (or the format check) over `OCRSTREAM_DECODE__PAGE_TIMEOUT_S`, or all pages of the request "
              "over `OCRSTREAM_DECODE__TIMEOUT_S`. The decoder process was killed and replaced; the same bytes "
              "would take as long again (a PDF page whose content is unbounded work, a file of chained headers)."),
    ErrorSpec(_E.IMAGE_TOO_COMPLEX, 422, "Decoding the image needed more memory than the decoder process may use "
              "(`OCRSTREAM_DECODE__MEMORY_MB`), or the decoder process died reading it."),
    ErrorSpec(_E.REQUEST_ID_CONFLICT, 409, "The chosen `request_id` is already taken by another request: another "
              "image (content SHA-256), another task, or another API key, at either door; or it names a request "
              "no claim holds (an id the system made; a document's page id, `<document id>:p<n>`, cannot be chosen at "
              "all: `invalid_request`). The first request keeps "
              "the id and its result; on the Kafka door the refused submission ends under its derived id (the "
              "message names the id it asked for), on the HTTP door it is answered 409. Resending the same image "
              "with the same id is an idempotent retry, not a conflict."),
    ErrorSpec(_E.IMAGE_URI_NOT_ALLOWED, None, "The submission's `s3://` `image_uri` is outside the buckets and key "
              "prefixes ingest may read (`OCRSTREAM_S3_ALLOWED_PREFIXES`; default: the bucket's upload prefix); "
              "nothing was read."),
    ErrorSpec(_E.STAGE_CRASH, None, "The stage handling this request died `OCRSTREAM_POISON_AFTER_DEATHS` times "
              "while it was in progress (killed, out of memory, crashed, or stopped without finishing it): it is "
              "not handled again and its record is sent to `ocr.dlq`. Not retried (the same record would take the "
              "stage down again)."),
    ErrorSpec(_E.UNSUPPORTED_TASK, 422, "The engine of this deployment cannot do the request's task (e.g. `extract` "
              "on the CPU engine): the message names the engines that can. Nothing is made up; submit it to a "
              "deployment running one of those engines."),
    ErrorSpec(_E.UNPARSABLE_OUTPUT, None, "The model's answer could not be read as the task's result (e.g. "
              "`extract` answered with prose, not JSON): the raw answer is kept in the result's `raw_output` for "
              "inspection. Not cached, so a later submission is read again."),
    ErrorSpec(_E.DOCUMENT_TOO_MANY_PAGES, 413, "A PDF or multi-page TIFF declared more pages than "
              "`OCRSTREAM_LIMITS__MAX_DOCUMENT_PAGES` (counted from its page tree or frame headers, before any "
              "page was rendered; docs/documents.md)."),
    ErrorSpec(_E.DOCUMENT_TOO_LARGE, 413, "The pages of a PDF or multi-page TIFF together held more pixels than "
              "`OCRSTREAM_LIMITS__MAX_DOCUMENT_PIXELS` (read from the headers, before any page was rendered)."),
    ErrorSpec(_E.DOCUMENT_PAGES_FAILED, None, "A document's share of failed pages was above "
              "`OCRSTREAM_MAX_PAGE_ERROR_RATE` (or every page failed): the document ends `error`; each page's own "
              "error is in the document result (docs/documents.md). Below it the document ends `partial`."),
    ErrorSpec(_E.HTTP_DOOR_UNVERIFIED, None, "A submission on `ocr.submit` marked as the HTTP door's (`door: http` "
              "or an `api_key_id`) that the HTTP door did not make: its `request_id` is not claimed by the HTTP door "
              "with that API key, content SHA-256 and task, its `image_uri` is not that content's object, or the "
              "object's bytes do not hash to it. It ends under its derived id (the message names the id it asked "
              "for); nothing was split or announced. Only the HTTP door may speak for an API key."),
    ErrorSpec(_H.UNAUTHORIZED, 401, "API keys are required (`OCRSTREAM_AUTH_REQUIRED`) and the call carried none, or "
              "a malformed, unknown or revoked one (`X-API-Key` or `Authorization: Bearer`); the answer has "
              "`WWW-Authenticate`."),
    ErrorSpec(_H.RATE_LIMITED, 429, "The API key's token bucket is empty (`OCRSTREAM_RATE_LIMIT_PER_S`, "
              "`OCRSTREAM_RATE_LIMIT_BURST`, or the key's own); a batch costs one token per image. Retry after "
              "`Retry-After` seconds."),
    ErrorSpec(_H.QUOTA_EXCEEDED, 429, "The API key used up its submissions of the UTC day "
              "(`OCRSTREAM_QUOTA_PER_DAY`, or the key's own); a batch counts one per image. `Retry-After`: until "
              "midnight UTC."),
    ErrorSpec(_H.TOO_MANY_UPLOADS, 429, "The API key (`OCRSTREAM_HTTP_UPLOADS_PER_KEY`) or the client address "
              "(`OCRSTREAM_HTTP_UPLOADS_PER_CLIENT`) already has that many large uploads in progress; nothing of "
              "this body was read. See `Retry-After`."),
    ErrorSpec(_H.NOT_FOUND, 404, "No such request or job, or another API key's (with keys on, a submission "
              "with a `job_id` or a close of a job the key did not create, or not yet recorded after "
              "`OCRSTREAM_HTTP_JOB_WAIT_S`); no such path. On `GET "
              "/v1/events`: none of the ids is the caller's (one that is not gets an `error` event instead)."),
    ErrorSpec(_H.REQUEST_TIMEOUT, 408, "The request body came too slowly: not within "
              "`OCRSTREAM_HTTP_BODY_TIMEOUT_S`, a pause over `OCRSTREAM_HTTP_BODY_IDLE_TIMEOUT_S`, or under "
              "`OCRSTREAM_HTTP_BODY_MIN_RATE_BYTES_PER_S` on average."),
    ErrorSpec(_H.CALLBACK_NOT_ALLOWED, 400, "The `callback_url` is refused (the message says why): not `http` or "
              "`https`, or with a user name; its host not on `OCRSTREAM_WEBHOOK_ALLOWED_HOSTS` (empty: no callback "
              "at all); or resolving to a loopback, private, link-local or other non-public address (allowed for "
              "local testing by `OCRSTREAM_WEBHOOK_ALLOW_PRIVATE`); or a request without an API key while the "
              "server has no `OCRSTREAM_WEBHOOK_SECRET` to sign it with."),
    ErrorSpec(_H.OVERLOADED, 503, "The door is full for now: the upload budget "
              "(`OCRSTREAM_HTTP_UPLOAD_BUDGET_BYTES`) cannot hold this body, or too many long-polls and event "
              "streams are waiting (`OCRSTREAM_HTTP_MAX_WAITERS`). Retry later (`Retry-After`)."),
    ErrorSpec(_H.UNAVAILABLE, 503, "Kafka, S3 or MariaDB did not answer (the request was not accepted: nothing "
              "was sent); retry later (`Retry-After` when known). With a `request_id` the retry is idempotent."),
    ErrorSpec(_H.METHOD_NOT_ALLOWED, 405, "The path exists but not with this HTTP method."),
    ErrorSpec(_H.CLIENT_CLOSED, 499, "The client closed the connection before its body was complete (nginx's "
              "status; only counted and logged: nobody reads the answer)."),
    ErrorSpec(_H.HTTP_ERROR, None, "Any other error of the HTTP framework itself, answered with the framework's "
              "status."),
    ErrorSpec(_H.JOB_EXPECTED_TOO_SMALL, 409, "`POST /v1/jobs/{id}/close` named fewer requests than the job "
              "already has final (the message says how many): nothing was sent; close it with at least that count "
              "(docs/jobs.md)."),
)

#: The one table: code value -> its row, in the order of the enums.
ERRORS: dict[str, ErrorSpec] = {row.code.value: row for row in _ROWS}


def http_status(code: ErrorCode | HttpErrorCode | str) -> int | None:
    """The HTTP status the door answers ``code`` with (None: never an HTTP answer's status).

    Raises:
        KeyError: ``code`` is no code of :data:`ERRORS`.
    """
    return ERRORS[code.value if isinstance(code, Enum) else code].http_status


#: Errors that may not recur on another attempt: when a lease holder ends with one of these, one
#: waiter for the same image is promoted and re-sent to inference instead of sharing the error.
#: Input errors and ``timeout`` are deterministic for identical bytes: every waiter shares them.
RETRYABLE_CODES: frozenset[ErrorCode] = frozenset({ErrorCode.ENGINE_ERROR, ErrorCode.INTERNAL_ERROR})
