"""Submissions the HTTP door hands to ingest: a document it stored, to be split (``docs/documents.md``).

The HTTP door stores an uploaded PDF or multi-page TIFF under its SHA-256 (``images/<sha[:2]>/<sha>``),
claims the request id in MariaDB (``request_claims``: door ``http``, its API key, the content
SHA-256 and the task) and publishes a :class:`~schemas.events.SubmitEvent` on ``ocr.submit`` with
``door: http``, its ``api_key_id`` and ``image_uri`` pointing at that object. Ingest believes the
mark only when the claim says the same (:func:`verify_claim`) and the object's bytes hash to the
claimed SHA-256 (:func:`check_content`): only the door writes ``http`` claims, so a plain Kafka
producer cannot speak for an API key (its request would be read under that key's ownership and cache
scope). A marked submission that fails either check ends ``http_door_unverified`` under its derived
id; nothing of it is split or announced.

A verified submission is read from the content object the claim names (the door's, outside
``OCRSTREAM_S3_ALLOWED_PREFIXES``, which bound what plain submissions may reference), its request
carries the ``api_key_id``, and its id is not claimed again (the door's claim is its own).
"""

from __future__ import annotations

from schemas.errors import ErrorCode
from schemas.events import SubmitEvent
from schemas.keys import image_object_key
from services.common.requests import claims
from services.common.requests.claims import RequestClaim
from services.common.db import Database
from services.common.errors import OcrError
from services.common.s3 import ObjectStore


def is_marked(event: SubmitEvent) -> bool:
    """Whether ``event`` says it comes from the HTTP door (``door: http`` or an ``api_key_id``)."""
    return event.door == "http" or event.api_key_id is not None


async def verify_claim(db: Database, store: ObjectStore, event: SubmitEvent) -> RequestClaim:
    """The HTTP door's claim backing a marked ``event`` (:func:`is_marked`), checked before any byte is read.

    The claim of ``event.request_id`` must be the door's (``door`` ``http``), with the event's API
    key and task and a content SHA-256, and ``event.image_uri`` that content's object in ``store``.

    Returns:
        The claim (its ``content_sha256`` is what the object must hash to: :func:`check_content`).

    Raises:
        OcrError: ``http_door_unverified``, the message saying what does not match.
        pymysql.OperationalError: MariaDB unreachable (the runner retries).
    """
    rid = event.request_id
    if rid is None:
        raise OcrError(ErrorCode.HTTP_DOOR_UNVERIFIED, "a submission marked as the HTTP door's names no request_id")
    held = await claims.held_claim(db, rid)
    if held is None or held.door != "http":
        why = "is not claimed" if held is None else f"is claimed by the {held.door} door"
        raise OcrError(ErrorCode.HTTP_DOOR_UNVERIFIED, f"request_id {rid!r} {why}, not by the HTTP door: "
                       "only the HTTP door may mark a submission door=http or give an api_key_id")
    if held.api_key_id != event.api_key_id or held.task != event.task or held.content_sha256 is None:
        raise OcrError(ErrorCode.HTTP_DOOR_UNVERIFIED, f"request_id {rid!r}: the HTTP door claimed it for another "
                       "API key, task or image than this submission names")
    expected = store.uri(image_object_key(held.content_sha256))
    if event.image_uri != expected:
        raise OcrError(ErrorCode.HTTP_DOOR_UNVERIFIED, f"request_id {rid!r}: image_uri "
                       f"{(event.image_uri or '(inline)')[:200]!r} is not the object the HTTP door stored ({expected})")
    return held


def check_content(held: RequestClaim, content_sha256: str) -> None:
    """Check that the bytes read for a verified submission hash to its claim's SHA-256.

    Raises:
        OcrError: ``http_door_unverified`` when they do not (the object was replaced).
    """
    if content_sha256 != held.content_sha256:
        raise OcrError(ErrorCode.HTTP_DOOR_UNVERIFIED, f"request_id {held.request_id!r}: the stored object hashes "
                       f"to {content_sha256[:12]}..., the HTTP door claimed {(held.content_sha256 or '')[:12]}...")
