"""Who holds each client-chosen request id: one durable claim per id, decided in one place.

Both doors call :func:`claim` when they accept a submission that names its own ``request_id``
(the Kafka door, ``services.ingest.handler``, after reading the image; the HTTP door,
``services.api.serving_submit``, after hashing the upload). The claim is a row of MariaDB's
``request_claims`` (migration ``006_request_claims.sql``), written with a plain ``INSERT`` on
the primary key ``request_id``: of any number of submissions racing for one id exactly one
inserts it (InnoDB's unique-key check); every other reads the row that won and is compared with
it by :func:`compare`, the one rule:

* the same Kafka record again (``origin``: topic/partition/offset; a redelivery): a retry;
* the same image (content SHA-256), task and API key: a retry (idempotent: answered with, or
  leading to, the same request);
* anything else: ``request_id_conflict``. A claim without an image (its submission was refused
  before the image was read) conflicts with every other submission: that id already has its
  final state.

Some ids are never claimed: a document's pages (``<document id>:p<n>``, named by ingest's
split), the HTTP door's own random ids and ingest's derived ids. A new claim on an id that
already has a final state in ``requests``, or that names a page of a registered document
(``documents``), is a conflict too (:func:`unclaimed_holder`, asked when no claim holds it): the
first final state is kept, so the claimer would otherwise be answered with another request's
result, or wait for one that never comes.

The row is never overwritten. Only its claimer may delete it again (:func:`release`, by its
``token``): the HTTP door does when the submission is refused or fails before it is accepted,
so the client's retry is not a conflict with a request that never started.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import pymysql

from schemas.events import new_id, now_ms
from services.common.db import Database
from services.common.errors import StoreUnavailable

_DUPLICATE_KEY = 1062  # MariaDB/MySQL ER_DUP_ENTRY
_PAGE_ID = re.compile(r"(.+):p([1-9][0-9]{0,8})")  # schemas.ids.page_request_id's form

_INSERT = """
INSERT INTO request_claims (request_id, content_sha256, task, api_key_id, door, origin, token, claimed_at_ms)
VALUES (%s,%s,%s,%s,%s,%s,%s,%s)
"""
_SELECT = """
SELECT request_id, content_sha256, task, api_key_id, door, origin, token, claimed_at_ms
FROM request_claims WHERE request_id IN ({ids})
"""
# the same record, first refused before its image was read (a missing object), then read after all
_UPGRADE = """
UPDATE request_claims SET content_sha256 = %s, task = %s
WHERE request_id = %s AND origin = %s AND content_sha256 IS NULL
"""


@dataclass(frozen=True)
class RequestClaim:
    """A submission's claim on its request id (one row of ``request_claims``).

    Attributes:
        request_id: The id (already valid by :mod:`schemas.ids`).
        content_sha256: Hex SHA-256 of the image; None when the submission ended before its
            image was read (refused: its final state is an error).
        task: The request's task.
        door: ``kafka`` or ``http`` (``migrated``: a request finished before claims existed).
        api_key_id: The HTTP door's API key; None for the Kafka door and for a door without keys.
        origin: The Kafka door: ``topic/partition/offset`` of the submission; None for HTTP.
        token: The claimer's own random mark (32 hex digits): :func:`release` needs it.
        claimed_at_ms: When it was taken, ms since the epoch.
    """

    request_id: str
    content_sha256: str | None
    task: str | None
    door: str
    api_key_id: str | None = None
    origin: str | None = None
    token: str = field(default_factory=new_id)
    claimed_at_ms: int = field(default_factory=now_ms)


@dataclass(frozen=True)
class ClaimOutcome:
    """What :func:`claim` decided.

    Attributes:
        kind: ``new`` (this call took the id), ``retry`` (the holder is the same submission or
            the same content) or ``conflict``.
        held: The claim holding the id: this call's own when ``new``.
        reason: For ``conflict``, a sentence naming the id and what differs (no detail of
            another API key's request); else None.
    """

    kind: Literal["new", "retry", "conflict"]
    held: RequestClaim
    reason: str | None = None


def compare(held: RequestClaim, mine: RequestClaim) -> tuple[Literal["retry", "conflict"], str | None]:
    """The one rule deciding whether ``mine`` may share ``held``'s request id (module docstring).

    Returns:
        ``("retry", None)`` or ``("conflict", reason)``.
    """
    rid = held.request_id
    if held.origin is not None and held.origin == mine.origin:
        return "retry", None
    if held.api_key_id != mine.api_key_id:
        if held.api_key_id is None:
            who = "a request made without an API key (the Kafka door, or the HTTP door with keys off)"
        else:
            who = "another API key" if mine.api_key_id is not None else "a request of an API key (the HTTP door)"
        return "conflict", f"request_id {rid!r} is already used by {who}"
    if held.content_sha256 is None:
        return "conflict", (f"request_id {rid!r} is already used by a submission that was refused before its "
                            "image was read (it has its final state)")
    if mine.content_sha256 is None:
        return "conflict", (f"request_id {rid!r} is already used by another request (content SHA-256 "
                            f"{held.content_sha256[:12]}...)")
    if held.content_sha256 != mine.content_sha256:
        return "conflict", (f"request_id {rid!r} is already used for a different image (content SHA-256 "
                            f"{held.content_sha256[:12]}..., this one's {mine.content_sha256[:12]}...)")
    if held.task != mine.task:
        return "conflict", f"request_id {rid!r} is already used for the same image with task {held.task!r}"
    return "retry", None


def _row(r: dict) -> RequestClaim:
    return RequestClaim(request_id=r["request_id"], content_sha256=r["content_sha256"], task=r["task"],
                        door=r["door"], api_key_id=r["api_key_id"], origin=r["origin"], token=r["token"],
                        claimed_at_ms=r["claimed_at_ms"])


async def held_claim(db: Database, request_id: str) -> RequestClaim | None:
    """The claim holding ``request_id``, or None.

    Raises:
        pymysql.MySQLError: MariaDB failed (``OperationalError``: unreachable, transient).
    """
    return (await held_claims(db, [request_id])).get(request_id)


async def held_claims(db: Database, request_ids: list[str]) -> dict[str, RequestClaim]:
    """:func:`held_claim` of many ids in one query: request id -> its claim (ids with none absent).

    Raises:
        pymysql.MySQLError: MariaDB failed (``OperationalError``: unreachable, transient).
    """
    if not request_ids:
        return {}
    rows = await db.query(_SELECT.format(ids=", ".join(["%s"] * len(request_ids))), *request_ids)
    return {r["request_id"]: _row(r) for r in rows}


async def claim(db: Database, mine: RequestClaim) -> ClaimOutcome:
    """Take ``mine.request_id`` for ``mine``, or say who holds it and whether ``mine`` is a retry of it.

    When no claim holds the id, first whether it is taken unclaimed (:func:`unclaimed_holder`:
    a conflict, with ``held`` this call's own, not inserted); then one ``INSERT`` when the id is
    new; a duplicate key is followed by one ``SELECT`` of the holder and :func:`compare`. Idempotent for the same submission (a redelivered Kafka record is a
    ``retry`` of its own claim).

    Raises:
        pymysql.OperationalError, pymysql.InterfaceError: MariaDB unreachable (transient: the
            Kafka door's runner retries, the HTTP door answers 503).
        StoreUnavailable: the holder was released three times between the insert and the read
            (a burst of failing twins at the HTTP door; transient).
    """
    args = (mine.request_id, mine.content_sha256, mine.task, mine.api_key_id, mine.door, mine.origin,
            mine.token, mine.claimed_at_ms)
    if await held_claim(db, mine.request_id) is None:
        reason = await unclaimed_holder(db, mine.request_id)
        if reason is not None:  # taken for good (nobody can claim it): no twin can slip in
            return ClaimOutcome("conflict", mine, reason)
    for _ in range(3):
        try:
            await db.execute(_INSERT, *args)
            return ClaimOutcome("new", mine)
        except pymysql.IntegrityError as exc:
            if not exc.args or exc.args[0] != _DUPLICATE_KEY:
                raise
        held = await held_claim(db, mine.request_id)
        if held is None:  # released by its claimer in between: try to take it again
            continue
        kind, reason = compare(held, mine)
        if (kind == "retry" and held.content_sha256 is None and mine.content_sha256 is not None
                and held.origin == mine.origin):
            await db.execute(_UPGRADE, mine.content_sha256, mine.task, mine.request_id, mine.origin)
        return ClaimOutcome(kind, held, reason)
    raise StoreUnavailable(f"request_id {mine.request_id!r} was claimed and released repeatedly; try again")


async def unclaimed_holder(db: Database, request_id: str) -> str | None:
    """Why ``request_id``, though no claim holds it, is taken (a conflict's reason), or None.

    Taken: it has a final state in ``requests`` (a document's page, or an id the system made),
    or it is ``<document id>:p<n>`` of a document registered in ``documents`` with at least
    ``n`` pages (a page still in flight). A page id in its hashed form (a document id over 60
    characters) is seen only once it has its final state.

    Raises:
        pymysql.MySQLError: MariaDB failed.
    """
    if await db.query("SELECT 1 FROM requests WHERE request_id = %s", request_id):
        return f"request_id {request_id!r} is already used by another request (it has its final state)"
    page = await registered_page(db, request_id)
    if page is None:
        return None
    return f"request_id {request_id!r} is page {page[1]} of the document {page[0]!r}"


async def registered_page(db: Database, request_id: str) -> tuple[str, int] | None:
    """``(document id, page number)`` when ``request_id`` is ``<document id>:p<n>`` of a document
    registered in ``documents`` with at least ``n`` pages (ingest split it), else None.

    Raises:
        pymysql.MySQLError: MariaDB failed.
    """
    page = _PAGE_ID.fullmatch(request_id)
    if page is None:
        return None
    rows = await db.query("SELECT page_count FROM documents WHERE document_id = %s", page.group(1))
    if rows and int(page.group(2)) <= int(rows[0]["page_count"]):
        return page.group(1), int(page.group(2))
    return None


async def release(db: Database, mine: RequestClaim) -> bool:
    """Give ``mine.request_id`` up again (only if ``mine`` still holds it: same token).

    Returns:
        True if a claim was deleted.

    Raises:
        pymysql.MySQLError: MariaDB failed.
    """
    return await db.execute("DELETE FROM request_claims WHERE request_id = %s AND token = %s",
                            mine.request_id, mine.token) > 0
