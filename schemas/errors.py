"""The stable list of error codes a request can end with (part of the public schema)."""

from enum import Enum


class ErrorCode(str, Enum):
    """Why a request ended with status ``error``.

    Codes are stable API: new codes may be added, existing ones never change meaning.
    """

    EMPTY_INPUT = "empty_input"
    """The image had zero bytes."""
    INPUT_TOO_LARGE = "input_too_large"
    """The upload exceeded the configured byte limit (``max_image_bytes``)."""
    UNSUPPORTED_FORMAT = "unsupported_format"
    """The bytes are not an image format the pipeline reads (sniffed from content, never the name)."""
    CORRUPT_IMAGE = "corrupt_image"
    """The format was recognised but the image data could not be decoded (e.g. truncated)."""
    IMAGE_TOO_LARGE = "image_too_large"
    """Width x height exceeded ``max_pixels`` (checked from the header, before decoding)."""
    TOO_MANY_PAGES = "too_many_pages"
    """A multi-page input (TIFF, GIF, PDF) had more pages than ``max_pages``."""
    MISSING_OBJECT = "missing_object"
    """The referenced S3 object does not exist."""
    INVALID_REQUEST = "invalid_request"
    """The submit event could not be parsed or failed its schema."""
    TIMEOUT = "timeout"
    """Inference of the image took longer than ``infer_timeout_s``."""
    ENGINE_ERROR = "engine_error"
    """The OCR engine raised on this image."""
    INTERNAL_ERROR = "internal_error"
    """A bug or an unexpected failure after bounded retries; the message says more."""
    ENGINE_CRASH = "engine_crash"
    """The OCR engine (its server) went away while it read this image alone, ``engine_crash_limit``
    times (a connection carrying it dropped, the retry refused): the image is not retried (the same
    bytes would take it down again)."""
    DECODE_TIMEOUT = "decode_timeout"
    """Decoding or rendering the image took longer than its wall-clock limit: one page (or the
    format check) over ``decode.page_timeout_s``, or all pages of the request over
    ``decode.timeout_s``. The decoder process was killed and replaced; the same bytes would take
    as long again (a PDF page whose content is unbounded work, a file of chained headers)."""
    IMAGE_TOO_COMPLEX = "image_too_complex"
    """Decoding the image needed more memory than the decoder process may use
    (``decode.memory_mb``), or the decoder process died reading it."""
    REQUEST_ID_CONFLICT = "request_id_conflict"
    """The chosen ``request_id`` is already taken by another request: another image (content
    SHA-256), another task, or another API key, at either door. The first request keeps the id
    and its result; on the Kafka door the refused submission ends under its derived id (the
    message names the id it asked for), on the HTTP door it is answered 409."""
    IMAGE_URI_NOT_ALLOWED = "image_uri_not_allowed"
    """The submission's ``s3://`` ``image_uri`` is outside the buckets and key prefixes ingest may
    read (``OCRSTREAM_S3_ALLOWED_PREFIXES``; default: the bucket's upload prefix); nothing was read."""
    STAGE_CRASH = "stage_crash"
    """The stage handling this request died ``poison_after_deaths`` times while it was in progress
    (killed, out of memory, crashed, or stopped without finishing it): it is not handled again and
    its record is sent to ``ocr.dlq``. Not retried (the same record would take the stage down again)."""


#: Errors that may not recur on another attempt: when a lease holder ends with one of these, one
#: waiter for the same image is promoted and re-sent to inference instead of sharing the error.
#: Input errors and ``timeout`` are deterministic for identical bytes: every waiter shares them.
RETRYABLE_CODES: frozenset[ErrorCode] = frozenset({ErrorCode.ENGINE_ERROR, ErrorCode.INTERNAL_ERROR})
