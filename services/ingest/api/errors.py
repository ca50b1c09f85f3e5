"""HTTP errors of the front door: a status plus a stable error code and a message.

Every error response has the body ``{"error": {"code": "...", "message": "..."}}``. Codes are
those of :class:`schemas.errors.ErrorCode` for bad images (``input_too_large``,
``unsupported_format``, ...) plus the HTTP door's own: ``unauthorized``, ``rate_limited``,
``quota_exceeded``, ``too_many_uploads`` (429: the key or client address has its uploads in
progress), ``not_found``, ``request_timeout`` (408), ``request_id_conflict`` (409), ``callback_not_allowed``, ``overloaded``, ``unavailable``,
``method_not_allowed``, ``client_closed`` (499, nginx's status for a client that left
mid-body: only counted and logged, nobody reads it); FastAPI's parameter checks answer 400 ``invalid_request``;
any other exception (a bug) answers 500 ``internal_error`` and its traceback goes to the log.
"""

from __future__ import annotations

import logging

import orjson
from starlette.requests import Request
from starlette.responses import Response

from schemas.errors import ErrorCode

log = logging.getLogger(__name__)

#: HTTP status for each image error code raised by :func:`services.ingest.accept.accept_image`.
STATUS_OF_CODE: dict[str, int] = {
    ErrorCode.EMPTY_INPUT.value: 400,
    ErrorCode.INPUT_TOO_LARGE.value: 413,
    ErrorCode.UNSUPPORTED_FORMAT.value: 415,
    ErrorCode.CORRUPT_IMAGE.value: 422,
    ErrorCode.IMAGE_TOO_LARGE.value: 413,
    ErrorCode.TOO_MANY_PAGES.value: 413,
    ErrorCode.INVALID_REQUEST.value: 400,
    ErrorCode.DECODE_TIMEOUT.value: 422,
    ErrorCode.IMAGE_TOO_COMPLEX.value: 422,
}


class ApiError(Exception):
    """An error answered as ``status`` with ``{"error": {"code", "message"}}``.

    Args:
        status: HTTP status code.
        code: Stable error code (see the module docstring).
        message: Human-readable detail.
        headers: Extra response headers (e.g. ``Retry-After`` on 429).
    """

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}

    def response(self) -> Response:
        """The JSON error response."""
        body = orjson.dumps({"error": {"code": self.code, "message": self.message}})
        return Response(body, status_code=self.status, media_type="application/json", headers=self.headers)


async def api_error_handler(_: Request, exc: Exception) -> Response:
    """Starlette exception handler for :class:`ApiError`."""
    assert isinstance(exc, ApiError)
    return exc.response()


async def validation_error_handler(_: Request, exc: Exception) -> Response:
    """FastAPI's parameter validation (``RequestValidationError``) as 400 ``invalid_request``
    naming the first bad parameter, e.g. ``query.wait: Input should be greater than or equal to 0``,
    instead of FastAPI's own 422 ``{"detail": [...]}`` shape."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if errors:
        first = errors[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = f"{where}: {first.get('msg', 'invalid')}"
    else:
        message = "invalid request"
    return ApiError(400, "invalid_request", message).response()


#: Error codes of Starlette's own HTTP errors (unknown path, wrong method).
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def http_error_handler(_: Request, exc: Exception) -> Response:
    """Starlette's ``HTTPException`` (404 unknown path, 405 wrong method ...) in the one error shape."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    headers = dict(getattr(exc, "headers", None) or {})
    return ApiError(status, _HTTP_CODES.get(status, "http_error"), str(detail), headers).response()


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    """Any exception no other handler took (a bug) as 500 ``internal_error`` in the one error shape,
    instead of Starlette's plain-text ``Internal Server Error``. The traceback is logged here with
    the method and path; the answer names no exception detail (it may hold internal data).
    Registered for ``Exception``, so Starlette calls it from ``ServerErrorMiddleware``, outside
    every other middleware (the ``POST /v1/ocr`` fast path included); that middleware then
    re-raises, so the server logs the exception once more."""
    log.error("api: unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path, exc_info=exc)
    return ApiError(500, "internal_error", "internal server error (see the server log)").response()
