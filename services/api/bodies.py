"""Small JSON request bodies (``POST /v1/jobs``, ``POST /v1/jobs/{id}/close``): read only after the
caller is authenticated, bounded, charged to the upload budget while read, then validated.

FastAPI reads and validates a body declared as a pydantic parameter before the endpoint runs: a
250 MB body would be read whole, outside the upload budget, before the API key was checked (a door
that requires keys answered 400 for it, not 401). These routes declare no body parameter; they call
:func:`read_json_body` after :meth:`Guard.check`.
"""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from schemas.errors import ErrorCode
from services.api.clients import Clients
from services.api.errors import ApiError
from services.api.uploads import limited_stream

M = TypeVar("M", bound=BaseModel)

JSON_BODY_MAX_BYTES = 65_536
"""Largest JSON body of the job routes, bytes (a job's create body with 50 fields of 100
characters and a 2,048-character webhook URL is under 8 KiB); over it 413 ``input_too_large``."""


async def read_json_body(request: Request, model: type[M], clients: Clients, key_id: str | None) -> M:
    """The request's JSON body as ``model``, read within :data:`JSON_BODY_MAX_BYTES` and the upload
    budget (:class:`~services.api.uploads.UploadGate`: the small-body budget for a small declared
    length, else the upload budget and the caller's upload slots), at the door's body pace.

    Args:
        request: The request, its caller already authenticated.
        model: The body's pydantic model.
        clients: The door's clients (``uploads``, ``pace``).
        key_id: The caller's API key id (None with keys off): its upload slots.

    Raises:
        ApiError: 413 ``input_too_large`` past the bound (a declared ``Content-Length`` over it
            before a byte is read); 400 ``invalid_request`` for a body that is not JSON (a lone
            surrogate escape such as ``"\\ud800"`` included: no UTF-8 store or event can hold it)
            or not the model (naming the first bad field as ``body.<field>``); 429 ``too_many_uploads``, 503
            ``overloaded``, 408 ``request_timeout``, 499 ``client_closed`` as for an upload.
    """
    held = clients.uploads.open(request, key_id, JSON_BODY_MAX_BYTES)
    try:
        data = b"".join([chunk async for chunk in limited_stream(request, JSON_BODY_MAX_BYTES, held, clients.pace)])
    finally:
        held.release()
    try:
        return model.model_validate_json(data or b"null")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(("body", *(str(p) for p in first.get("loc", ()))))
        raise ApiError(ErrorCode.INVALID_REQUEST, f"{where}: {first.get('msg', 'invalid')}") from None
