"""Whether a request id that has no final state yet was accepted: "pending" or "unknown".

One rule, for every reader of a request's state (``ocrstream status``; the HTTP door's
``GET /v1/ocr/{id}`` reads the same three places). An id without a row in ``requests`` was
accepted, and is pending, when

* Redis holds the HTTP door's accepted marker (``<prefix>:req:<id>``,
  :meth:`~services.common.cache.entries.ResultCache.mark_accepted`; its value names the API key);
* or a claim holds it (:func:`services.common.requests.claims.held_claim`: an id chosen by its submitter,
  claimed by ingest once it read the submission, or by the HTTP door);
* or it is a registered document (:func:`services.common.documents.state.progress`: a PDF or TIFF
  split by ingest, whatever its id), assembled when all its pages are final;
* or it names a page of a registered document (``<document id>:p<n>``,
  :func:`services.common.requests.claims.registered_page`: split by ingest, not final yet).

Otherwise it is unknown: never submitted, mistyped, another namespace's, or submitted to Kafka
and not read by ingest yet (a Kafka door's id is known from the moment ingest claims it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import orjson

from services.common.requests import claims

from services.common.documents import state as documents
from services.common.cache.entries import CacheUnavailable, ResultCache
from services.common.db import Database


@dataclass(frozen=True)
class Accepted:
    """How an id without a final state is known to be accepted.

    Attributes:
        by: ``marker`` (Redis, the HTTP door), ``claim`` (MariaDB's ``request_claims``),
            ``document`` (a document in ``documents``) or ``page`` (one of its pages).
        api_key_id: The API key that made the request (the HTTP door with keys on); else None.
        document_id, page_number: For ``page``: its document and 1-based page number.
    """

    by: Literal["marker", "claim", "document", "page"]
    api_key_id: str | None = None
    document_id: str | None = None
    page_number: int | None = None


async def accepted(db: Database, cache: ResultCache, request_id: str) -> Accepted | None:
    """Whether ``request_id``, which has no final state in ``requests``, was accepted (module docstring).

    Redis's marker is read first; an id it does not hold may still be claimed, a document or a
    page (MariaDB).

    Returns:
        How it is known to be accepted, or None when it is not (unknown).

    Raises:
        CacheUnavailable: Redis did not answer and MariaDB does not know the id either: whether
            the HTTP door accepted it cannot be told (its own ids are in Redis only).
        pymysql.MySQLError: MariaDB failed.
    """
    try:
        raw = await cache.accepted(request_id)
        redis_down = None
    except CacheUnavailable as exc:
        raw, redis_down = None, exc
    if raw is not None:
        return Accepted("marker", api_key_id=orjson.loads(raw).get("key"))
    held = await claims.held_claim(db, request_id)
    if held is not None:
        return Accepted("claim", api_key_id=held.api_key_id)
    if await documents.progress(db, request_id) is not None:
        return Accepted("document")
    page = await claims.registered_page(db, request_id)
    if page is not None:
        return Accepted("page", document_id=page[0], page_number=page[1])
    if redis_down is not None:
        raise redis_down
    return None
