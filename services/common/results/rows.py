"""The ``requests`` and ``results`` tables: a request's final state and a cache key's OCR output.

A request's row holds its result document (bounded by ``mysql.row_max_bytes``:
:func:`bound_document`); a result's row holds its text and, for ``extract``, its fields
(``result_fields``). The sink writes both; the door, the CLI and document assembly read them.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from schemas.events import ResultDocument
from schemas.reading import TASK_TEXT_ANSWERS
from services.common.db import Database

_UPSERT_REQUEST = """
INSERT INTO requests (request_id, status, error_code, error_message, content_sha256, cache_key, cache_hit,
  task, source, filename, line_count, result_uri, trace_id, submitted_at_ms, completed_at_ms, total_ms,
  timings_json, document_json, document_truncated)
VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)
ON DUPLICATE KEY UPDATE request_id = request_id
"""
# A request's final state is written once: a replayed completion never overwrites the first
# one, so a request has exactly one final state even if it was (wrongly) computed twice.

_INSERT_FIELD = """
INSERT INTO result_fields (cache_key, position, content_sha256, field_name, value, created_at_ms)
VALUES (%s,%s,%s,%s,%s,%s)
"""
_UPSERT_RESULT = """
INSERT INTO results (cache_key, content_sha256, engine, model, model_revision, task, result_uri,
  line_count, text, text_truncated, created_at_ms)
VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)
ON DUPLICATE KEY UPDATE result_uri = VALUES(result_uri), line_count = VALUES(line_count), text = VALUES(text),
  text_truncated = VALUES(text_truncated)
"""


def cut_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of ``text`` whose UTF-8 encoding has at most ``max_bytes`` bytes (never
    half a character)."""
    raw = text.encode()
    return text if len(raw) <= max_bytes else raw[:max_bytes].decode(errors="ignore")


def _json_len(text: str) -> int:
    """Bytes of ``text`` as a JSON string, quotes excluded (the same minimal escaping as pydantic's)."""
    return len(orjson.dumps(text)) - 2


def bound_document(doc: ResultDocument, max_bytes: int) -> tuple[ResultDocument, str]:
    """``doc`` as its ``requests`` row holds it, and that row's ``document_json``.

    Within ``max_bytes`` (bytes of UTF-8 JSON) it is unchanged. Over it, its ``lines`` are left
    out (``lines_omitted`` counts them); still over, a task's ``markdown``/``html``/``latex``/
    ``translation`` (which ``text`` repeats) are left out; still over, ``text`` keeps its longest prefix that fits
    (``text_truncated``; found by bisection on the prefix's JSON length, about 20 encodings of at
    most ``max_bytes``). A summary over the bound without lines or text (not possible with the
    field limits events carry) is returned as it is. The whole document is the OCR output at
    ``result_uri`` (the sink stores it there).
    """
    raw = doc.model_dump_json(by_alias=True)
    if len(raw.encode()) <= max_bytes:
        return doc, raw
    if doc.lines:
        doc = doc.model_copy(update={"lines": [], "lines_omitted": doc.lines_omitted + len(doc.lines)})
        raw = doc.model_dump_json(by_alias=True)
        if len(raw.encode()) <= max_bytes:
            return doc, raw
    slots = {k: None for k in TASK_TEXT_ANSWERS if getattr(doc, k) is not None}
    if slots:  # a task's text is its ``text`` too (services/common/results/build.py): kept there, cut below
        doc = doc.model_copy(update=slots)
        raw = doc.model_dump_json(by_alias=True)
        if len(raw.encode()) <= max_bytes:
            return doc, raw
    if not doc.text:
        return doc, raw
    text = doc.text
    budget = max_bytes - len(doc.model_copy(update={"text": "", "text_truncated": True}).model_dump_json(
        by_alias=True).encode())
    lo, hi = 0, min(len(text), max(0, budget))  # a character is at least one byte of JSON
    while lo < hi:  # the longest prefix whose JSON fits the budget
        mid = (lo + hi + 1) // 2
        if _json_len(text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    doc = doc.model_copy(update={"text": text[:lo], "text_truncated": True})
    return doc, doc.model_dump_json(by_alias=True)


class ResultRows:
    """Reads and writes of the ``requests`` and ``results`` rows over a :class:`Database`.

    Args:
        db: The pool; its ``cfg.row_max_bytes`` bounds each row.
    """

    def __init__(self, db: Database):
        self.db = db

    def _write_requests(self, cur, docs: list[ResultDocument]) -> dict[str, ResultDocument]:
        rows, bounded = [], {}
        for full in docs:
            d, document_json = bound_document(full, self.db.cfg.row_max_bytes)
            bounded.setdefault(d.request_id, (d, document_json))
            rows.append(
                (
                    d.request_id,
                    d.status,
                    d.error.code.value if d.error else None,
                    d.error.message[:1024] if d.error else None,
                    d.content_sha256,
                    d.cache_key,
                    int(d.cache_hit),
                    d.task[:64],  # bounded where requests enter (ingest, the door); a stray producer's
                    d.source[:64],  # longer value must not cost the request its row (whole in document_json)
                    (d.filename or "")[:512] or None,
                    len(d.lines) + d.lines_omitted,
                    d.result_uri,
                    d.trace_id,
                    d.submitted_at_ms,
                    d.completed_at_ms,
                    d.timings_ms.get("total"),
                    orjson.dumps(d.timings_ms).decode(),
                    document_json,
                    int(d is not full),
                )
            )
        # one multi-row INSERT: each new row counts 1, each already recorded request 0
        # (ON DUPLICATE KEY UPDATE that changes nothing; the client does not set CLIENT_FOUND_ROWS)
        inserted = cur.executemany(_UPSERT_REQUEST, rows)
        if inserted == len(rows) and len(bounded) == len(rows):
            # every row is new: the database holds exactly these documents (the usual case,
            # no second round trip)
            return {rid: d for rid, (d, _) in bounded.items()}
        # a replay (or a request twice in the batch): read back what the database holds
        marks = ",".join(["%s"] * len(bounded))
        cur.execute(f"SELECT request_id, document_json FROM requests WHERE request_id IN ({marks})",
                    tuple(bounded))
        return {rid: ResultDocument.model_validate_json(doc) for rid, doc in cur.fetchall()}

    async def write_requests(self, docs: list[ResultDocument]) -> dict[str, ResultDocument]:
        """Insert each request's final state; a request already recorded keeps its first state.
        A document over ``row_max_bytes`` is stored as :func:`bound_document` cuts it.

        Returns:
            The final state the database holds for each request of ``docs``, by request id: when
            every row was new, the (bounded) documents just written, with no read; otherwise what
            one ``SELECT`` on the same connection reads back (a replayed result gets the first
            final state). One worker-thread hop and one or two round trips to MariaDB in all.
        """
        if not docs:
            return {}
        return await self.db.with_cursor("write_requests", self._write_requests, docs)

    @staticmethod
    def _write_result(cur, row: tuple) -> None:
        cur.execute(_UPSERT_RESULT, row)

    @staticmethod
    def _write_result_fields(cur, row: tuple, fields: list[tuple]) -> None:
        cur.execute(_UPSERT_RESULT, row)
        cur.execute("DELETE FROM result_fields WHERE cache_key = %s", (row[0],))
        cur.executemany(_INSERT_FIELD, fields)

    async def write_result(
        self, *, cache_key: str, content_sha256: str, engine: str, model: str, model_revision: str,
        task: str, result_uri: str, line_count: int, text: str, created_at_ms: int,
        fields: Mapping[str, str | None] | None = None,
    ) -> None:
        """Upsert the OCR output row of one cache key (idempotent). A ``text`` over ``row_max_bytes``
        (UTF-8) keeps its first part, ``text_truncated`` = 1; the whole is at ``result_uri``.
        ``fields`` (an ``extract`` result: field name -> value or None, in answer order): the key's
        ``result_fields`` rows, one per field, replaced in the same transaction (a replay writes
        the same rows)."""
        kept = cut_utf8(text, self.db.cfg.row_max_bytes)
        row = (cache_key, content_sha256, engine, model, model_revision, task, result_uri, line_count, kept,
               int(kept is not text), created_at_ms)
        if fields is None:
            await self.db.with_cursor("write_result", self._write_result, row)
            return
        rows = [(cache_key, i, content_sha256, name, value, created_at_ms)
                for i, (name, value) in enumerate(fields.items())]
        await self.db.transact("write_result", self._write_result_fields, row, rows)

    async def get_requests(self, request_ids: list[str]) -> dict[str, ResultDocument]:
        """The stored final results of ``request_ids`` that have completed, by request id."""
        if not request_ids:
            return {}
        ids = list(dict.fromkeys(request_ids))
        marks = ",".join(["%s"] * len(ids))
        rows = await self.db.query(f"SELECT request_id, document_json FROM requests WHERE request_id IN ({marks})", *ids)
        return {r["request_id"]: ResultDocument.model_validate_json(r["document_json"]) for r in rows}

    async def get_request(self, request_id: str) -> ResultDocument | None:
        """The final result of ``request_id``, or None if it has not completed."""
        rows = await self.db.query("SELECT document_json FROM requests WHERE request_id = %s", request_id)
        return ResultDocument.model_validate_json(rows[0]["document_json"]) if rows else None
