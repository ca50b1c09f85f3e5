"""A document's state in MariaDB (migration 009): its row, its pages' final states, its progress.

Written by ingest (:func:`register`, before any page is announced) and the sink
(:func:`record_page`, after the page's final state is written; :func:`mark_assembled`); read by
the sink's assembly and ``ocrstream document``. Every write is idempotent, so the counts are exact
under replay and survive a SIGKILL of any stage (``docs/documents.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.events import RequestEvent, ResultDocument
from services.common.db import Database
from services.common.wording import plural


@dataclass(frozen=True)
class Progress:
    """How far a document is: ``final`` of ``page_count`` pages have a final state, ``failed`` of
    them ended in error; ``status``/``result_uri`` once it is assembled (else None)."""

    document_id: str
    page_count: int
    final: int
    failed: int
    status: str | None
    result_uri: str | None

    def line(self) -> str:
        """One line for people, e.g. ``doc-7: 12/40 pages final (1 failed), assembling when all are``."""
        end = (f"{self.status}, {self.result_uri}" if self.status
               else "assembled when all are final")
        return (f"{self.document_id}: {self.final}/{plural(self.page_count, 'page')} final "
                f"({self.failed} failed); {end}")


async def register(db: Database, doc: RequestEvent, page_count: int, created_at_ms: int) -> None:
    """Insert the document's row unless it is there (a replay of the split keeps the first).

    Raises:
        pymysql.OperationalError: MariaDB unreachable (the runner retries).
    """
    await db.execute(
        "INSERT IGNORE INTO documents (document_id, content_sha256, page_count, request_json, created_at_ms)"
        " VALUES (%s,%s,%s,%s,%s)",
        doc.request_id, doc.content_sha256, page_count, doc.model_dump_json(by_alias=True), created_at_ms)


def _record_page(cur, page: ResultDocument) -> bool:
    cur.execute("SELECT page_count, completed_by FROM documents WHERE document_id = %s FOR UPDATE",
                (page.document_id,))
    row = cur.fetchone()
    if row is None:
        return False  # a page whose document was never registered (a stray producer): nothing to assemble
    cur.execute(
        "INSERT INTO document_pages (document_id, page_number, request_id, status, error_code, content_sha256,"
        " completed_at_ms) VALUES (%s,%s,%s,%s,%s,%s,%s) ON DUPLICATE KEY UPDATE document_id = document_id",
        (page.document_id, page.page_number, page.request_id, page.status,
         page.error.code.value if page.error else None, page.content_sha256, page.completed_at_ms))
    if row["completed_by"] is None:
        cur.execute("SELECT COUNT(*) AS n FROM document_pages WHERE document_id = %s", (page.document_id,))
        if cur.fetchone()["n"] >= row["page_count"]:
            cur.execute("UPDATE documents SET completed_by = %s WHERE document_id = %s",
                        (page.page_number, page.document_id))
            return True
        return False
    return row["completed_by"] == page.page_number


async def record_page(db: Database, page: ResultDocument) -> bool:
    """Record one page's final state (the first kept) and say whether this page completes its document.

    In one transaction holding the document's row lock: upsert the ``document_pages`` row; when no
    page has completed the document yet and every page now has a row, this page is recorded as the
    one that did (``completed_by``). True for that page, on its first write and on every replay of
    it (so a sink that died after this and before the document's completion was sent sends it on
    the replay); False for every other page, so a document is assembled once in the normal case.

    Args:
        page: The page's final state as MariaDB holds it (``document_id`` and ``page_number`` set).

    Raises:
        pymysql.OperationalError: MariaDB unreachable (the runner retries).
    """
    return bool(await db.transact("record_page", _record_page, page))


async def document_row(db: Database, document_id: str) -> tuple[RequestEvent, int] | None:
    """The document's request and page count, or None when no such document was registered."""
    rows = await db.query("SELECT request_json, page_count FROM documents WHERE document_id = %s", document_id)
    if not rows:
        return None
    return RequestEvent.model_validate_json(rows[0]["request_json"]), int(rows[0]["page_count"])


async def page_requests(db: Database, document_id: str) -> list[tuple[int, str]]:
    """``(page_number, request_id)`` of every recorded page, in page order."""
    rows = await db.query("SELECT page_number, request_id FROM document_pages WHERE document_id = %s"
                          " ORDER BY page_number", document_id)
    return [(int(r["page_number"]), r["request_id"]) for r in rows]


async def mark_assembled(db: Database, document_id: str, status: str, result_uri: str) -> None:
    """Note the assembled document's status and result (what ``ocrstream document`` shows)."""
    await db.execute("UPDATE documents SET status = %s, result_uri = %s WHERE document_id = %s",
                     status, result_uri, document_id)


async def progress(db: Database, document_id: str) -> Progress | None:
    """The document's progress, or None when no such document was registered (or is not a document)."""
    rows = await db.query(
        "SELECT d.page_count, d.status, d.result_uri, COUNT(p.page_number) AS final,"
        " COALESCE(SUM(p.status = 'error'), 0) AS failed FROM documents d"
        " LEFT JOIN document_pages p ON p.document_id = d.document_id WHERE d.document_id = %s"
        " GROUP BY d.document_id, d.page_count, d.status, d.result_uri", document_id)
    if not rows:
        return None
    r = rows[0]
    return Progress(document_id, int(r["page_count"]), int(r["final"]), int(r["failed"]), r["status"], r["result_uri"])
