"""HTTP errors of the front door: a stable error code, its status, and a message.

Every error response has the body ``{"error": {"code": "...", "message": "..."}}``. The codes and
their HTTP statuses are the one table :data:`schemas.errors.ERRORS` (``docs/errors.md``): the
image error codes of :class:`~schemas.errors.ErrorCode` and the door's own
:class:`~schemas.errors.HttpErrorCode`. FastAPI's parameter checks answer 400 ``invalid_request``;
Starlette's 404/405 ``not_found``/``method_not_allowed``; any other exception (a bug) answers 500
``internal_error`` and its traceback goes to the log.
"""

from __future__ import annotations

import logging

import orjson
from starlette.requests import Request
from starlette.responses import Response

from schemas.errors import ErrorCode, HttpErrorCode, http_status
from services.common.errors import OcrstreamError

log = logging.getLogger(__name__)


class ApiError(OcrstreamError):
    """An error answered with ``{"error": {"code", "message"}}`` and the code's HTTP status.

    Args:
        code: A code of :data:`schemas.errors.ERRORS` (an enum member or its value).
        message: Human-readable detail.
        headers: Extra response headers (e.g. ``Retry-After`` on 429).
        status: Only for ``http_error`` (the framework's own status); every other code's status
            comes from the table.

    Raises:
        KeyError: ``code`` is not in the table.
        ValueError: ``code`` has no HTTP status and none was given.
    """

    def __init__(self, code: ErrorCode | HttpErrorCode | str, message: str, headers: dict[str, str] | None = None,
                 *, status: int | None = None):
        super().__init__(message)
        self.code = code.value if isinstance(code, (ErrorCode, HttpErrorCode)) else code
        resolved = http_status(self.code) or status
        if resolved is None:
            raise ValueError(f"error code {self.code!r} is never an HTTP answer (schemas/errors.py ERRORS)")
        self.status = resolved
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


def _range_of(request: Request, loc: tuple) -> str | None:
    """``"0 to 60"`` for a query parameter of the matched route with bounds (``Query(ge=, le=)``),
    else None."""
    if len(loc) != 2 or loc[0] != "query":
        return None
    dependant = getattr(request.scope.get("route"), "dependant", None)
    field = next((f for f in getattr(dependant, "query_params", ()) if f.alias == loc[1]), None)
    if field is None:
        return None
    low = next((m.ge for m in field.field_info.metadata if getattr(m, "ge", None) is not None), None)
    high = next((m.le for m in field.field_info.metadata if getattr(m, "le", None) is not None), None)
    if low is None or high is None:
        return None
    return f"{low:g} to {high:g}"


async def validation_error_handler(request: Request, exc: Exception) -> Response:
    """FastAPI's parameter validation (``RequestValidationError``) as 400 ``invalid_request``
    naming the first bad parameter and, for a bounded number, its range, e.g. ``query.wait: Input
    should be less than or equal to 60 (wait: 0 to 60)``, instead of FastAPI's own 422
    ``{"detail": [...]}`` shape."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if errors:
        first = errors[0]
        loc = tuple(first.get("loc", ()))
        message = f"{'.'.join(str(p) for p in loc)}: {first.get('msg', 'invalid')}"
        if (bounds := _range_of(request, loc)) is not None:
            message += f" ({loc[1]}: {bounds})"
    else:
        message = "invalid request"
    return ApiError(ErrorCode.INVALID_REQUEST, message).response()


async def http_error_handler(_: Request, exc: Exception) -> Response:
    """Starlette's ``HTTPException`` (404 unknown path, 405 wrong method ...) in the one error shape:
    the table's code of that status (``not_found``, ``method_not_allowed``), else ``http_error``
    with Starlette's status."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    headers = dict(getattr(exc, "headers", None) or {})
    code = next((c for c in (HttpErrorCode.NOT_FOUND, HttpErrorCode.METHOD_NOT_ALLOWED) if http_status(c) == status),
                HttpErrorCode.HTTP_ERROR)
    return ApiError(code, str(detail), headers, status=status).response()


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    """Any exception no other handler took (a bug) as 500 ``internal_error`` in the one error shape,
    instead of Starlette's plain-text ``Internal Server Error``. The traceback is logged here with
    the method and path; the answer names no exception detail (it may hold internal data).
    Registered for ``Exception``, so Starlette calls it from ``ServerErrorMiddleware``, outside
    every other middleware; that middleware then re-raises, so the server logs the exception once more."""
    log.error("api: unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path, exc_info=exc)
    return ApiError(ErrorCode.INTERNAL_ERROR, "internal server error (see the server log)").response()
