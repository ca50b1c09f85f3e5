"""Response bodies of the HTTP front door (documented in the OpenAPI spec)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from schemas.events import ResultDocument

Status = Literal["pending", "ok", "error"]


class ApiErrorDetail(BaseModel):
    """An error: a stable ``code`` (an image error code of the pipeline, or one of the HTTP door's
    own such as ``rate_limited``) and a human-readable ``message``."""

    code: str
    message: str


class Links(BaseModel):
    """Where to read the request's state: ``self`` (now) and ``wait`` (long-poll)."""

    self: str
    wait: str


class OcrResponse(BaseModel):
    """The state of one request.

    ``status`` is ``pending`` until the result is stored, then the result's own ``ok`` or
    ``error``; ``result`` is the full :class:`ResultDocument` once finished, else null.
    """

    request_id: str
    status: Status
    cache_hit: bool = False
    result: ResultDocument | None = None
    error: ApiErrorDetail | None = None
    links: Links


class BatchItem(OcrResponse):
    """One file of a batch upload; a file rejected at upload has ``status`` ``error`` and no links."""

    index: int = Field(ge=0, description="position of the file in the upload")
    filename: str | None = None
    links: Links | None = None  # type: ignore[assignment]


class BatchLinks(BaseModel):
    """Where to follow a whole batch: ``events``, the server-sent event stream
    (``GET /v1/events``) of every item that has a request id; null when no item has one."""

    events: str | None = None


class BatchResponse(BaseModel):
    """One item per uploaded file, in upload order, and links for the whole batch."""

    items: list[BatchItem]
    links: BatchLinks = Field(default_factory=BatchLinks)


class ApiErrorBody(BaseModel):
    """Body of every 4xx/5xx answer."""

    error: ApiErrorDetail


class Health(BaseModel):
    """``/healthz`` and ``/readyz``: ``ok`` and, when not ready, what is missing."""

    ok: bool
    not_ready: list[str] = Field(default_factory=list)
