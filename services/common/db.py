"""MariaDB/MySQL access (PyMySQL in threads): migrations, request and result upserts, reads."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Mapping
from contextlib import contextmanager
from importlib import resources

import orjson
import pymysql

from schemas.events import ResultDocument
from services.common.settings import MySQLSettings
from services.common.telemetry import Telemetry

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

# Connection-level failures (PyMySQL CR_* codes): the server went away, so every idle pooled
# connection is likely dead too (a restarted server) and is dropped with the failed one.
_CONNECTION_LOST = frozenset({2003, 2006, 2013, 2055})


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
    slots = {k: None for k in ("markdown", "html", "latex", "translation") if getattr(doc, k) is not None}
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


class Database:
    """A small pool of PyMySQL connections used from worker threads.

    Connection errors propagate as ``pymysql.OperationalError`` (retriable for the runner);
    the broken connection is dropped and a fresh one is opened on the next call (when the server
    went away, the idle ones are dropped too). Rows are bounded by ``cfg.row_max_bytes``
    (:func:`bound_document`).

    Args:
        cfg: MySQL settings.
        pool_size: Connections kept open.
        telemetry: Where call latencies are recorded; None to skip.
    """

    def __init__(self, cfg: MySQLSettings, pool_size: int = 4, telemetry: Telemetry | None = None):
        self.cfg = cfg
        self.telemetry = telemetry
        self._probe_conn: pymysql.connections.Connection | None = None
        self._pool: queue.LifoQueue[pymysql.connections.Connection | None] = queue.LifoQueue()
        for _ in range(pool_size):
            self._pool.put(None)

    def _connect(self) -> pymysql.connections.Connection:
        return pymysql.connect(
            host=self.cfg.host,
            port=self.cfg.port,
            user=self.cfg.user,
            password=self.cfg.password.get_secret_value(),
            database=self.cfg.database,
            connect_timeout=self.cfg.connect_timeout_s,
            read_timeout=30,
            write_timeout=30,
            autocommit=True,
            charset="utf8mb4",
        )

    @contextmanager
    def _conn(self):
        conn = self._pool.get()
        try:
            if conn is None:
                conn = self._connect()
            yield conn
        except (pymysql.OperationalError, pymysql.InterfaceError) as exc:
            if conn is not None:
                try:
                    conn.close()
                except Exception:
                    pass
            conn = None
            if isinstance(exc, pymysql.InterfaceError) or (exc.args and exc.args[0] in _CONNECTION_LOST):
                self._drop_idle()
            raise
        finally:
            self._pool.put(conn)

    def _drop_idle(self) -> None:
        """Close every idle pooled connection (a fresh one is opened on next use)."""
        taken = 0
        while True:
            try:
                conn = self._pool.get_nowait()
            except queue.Empty:
                break
            taken += 1
            if conn is not None:
                try:
                    conn.close()
                except Exception:
                    pass
        for _ in range(taken):
            self._pool.put(None)

    async def _run(self, op: str, fn, *args):
        if self.telemetry is None:
            return await asyncio.to_thread(fn, *args)
        with self.telemetry.store_call("mysql", op):
            return await asyncio.to_thread(fn, *args)

    def _ping(self) -> bool:
        # a connection of its own: a probe never waits for (or holds) one of the pool's
        if self._probe_conn is None:
            self._probe_conn = self._connect()
        try:
            self._probe_conn.ping(reconnect=True)
            return True
        except Exception:
            self._probe_conn = None
            raise

    async def ping(self) -> bool:
        """True if MariaDB answers ``SELECT 1`` (a readiness check)."""
        return await self._run("ping", self._ping)

    # -- schema ---------------------------------------------------------------------------
    def _migrate(self) -> list[str]:
        applied = []
        with self._conn() as conn, conn.cursor() as cur:
            cur.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version VARCHAR(64) PRIMARY KEY,"
                " applied_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)"
            )
            cur.execute("SELECT version FROM schema_migrations")
            done = {row[0] for row in cur.fetchall()}
            files = sorted(
                f for f in resources.files("services.common.migrations").iterdir() if f.name.endswith(".sql")
            )
            for f in files:
                version = f.name.removesuffix(".sql")
                if version in done:
                    continue
                for stmt in [s.strip() for s in f.read_text().split(";")]:
                    body = "\n".join(line for line in stmt.splitlines() if not line.strip().startswith("--"))
                    if body.strip():
                        cur.execute(body)
                cur.execute("INSERT INTO schema_migrations (version) VALUES (%s)", (version,))
                applied.append(version)
        return applied

    async def migrate(self) -> list[str]:
        """Apply the SQL files in ``services/common/migrations`` not applied yet; returns their versions."""
        return await self._run("migrate", self._migrate)

    # -- writes ---------------------------------------------------------------------------
    def _write_requests(self, docs: list[ResultDocument]) -> dict[str, ResultDocument]:
        rows, bounded = [], {}
        for full in docs:
            d, document_json = bound_document(full, self.cfg.row_max_bytes)
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
        with self._conn() as conn, conn.cursor() as cur:
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
        return await self._run("write_requests", self._write_requests, docs)

    def _write_result(self, row: tuple) -> None:
        with self._conn() as conn, conn.cursor() as cur:
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
        kept = cut_utf8(text, self.cfg.row_max_bytes)
        row = (cache_key, content_sha256, engine, model, model_revision, task, result_uri, line_count, kept,
               int(kept is not text), created_at_ms)
        if fields is None:
            await self._run("write_result", self._write_result, row)
            return
        rows = [(cache_key, i, content_sha256, name, value, created_at_ms)
                for i, (name, value) in enumerate(fields.items())]
        await self._run("write_result", self._transact, self._write_result_fields, (row, rows))

    # -- reads ----------------------------------------------------------------------------
    def _query(self, sql: str, args: tuple) -> list[dict]:
        with self._conn() as conn, conn.cursor(pymysql.cursors.DictCursor) as cur:
            cur.execute(sql, args)
            return list(cur.fetchall())

    async def query(self, sql: str, *args) -> list[dict]:
        """Run a read query; rows as dicts."""
        return await self._run("query", self._query, sql, args)

    def _stream(self, sql: str, args: tuple, consume):
        with self._conn() as conn, conn.cursor(pymysql.cursors.SSDictCursor) as cur:
            cur.execute(sql, args)
            return consume(iter(cur.fetchone, None))

    async def stream(self, op: str, sql: str, args: tuple, consume):
        """Run a read query with a server-side cursor (``SSDictCursor``: rows come from the server
        as ``consume`` reads them, never all in memory) and return ``consume(rows)``, where
        ``rows`` iterates dicts. ``consume`` runs in the worker thread and must read every row
        (it may write files; it must not touch the event loop).

        Args:
            op: Operation name for the call-latency metric.
        """
        return await self._run(op, self._stream, sql, args, consume)

    def _transact(self, fn, args: tuple):
        with self._conn() as conn:
            conn.begin()
            try:
                with conn.cursor(pymysql.cursors.DictCursor) as cur:
                    out = fn(cur, *args)
                conn.commit()
                return out
            except BaseException:
                try:
                    conn.rollback()
                except Exception:  # the connection is gone: the server rolls back on its own
                    pass
                raise

    async def transact(self, op: str, fn, *args):
        """Run ``fn(cursor, *args)`` (in a worker thread) inside one transaction on a pooled
        connection: committed when it returns, rolled back when it raises. The cursor yields
        dicts. Returns what ``fn`` returns.

        Args:
            op: Operation name for the call-latency metric.
        """
        return await self._run(op, self._transact, fn, args)

    def _execute(self, sql: str, args: tuple) -> int:
        with self._conn() as conn, conn.cursor() as cur:
            return cur.execute(sql, args)

    async def execute(self, sql: str, *args) -> int:
        """Run one write statement (autocommit); returns the number of rows it changed.

        Raises:
            pymysql.IntegrityError: a unique key was violated (e.g. a duplicate primary key).
            pymysql.OperationalError: MariaDB unreachable.
        """
        return await self._run("execute", self._execute, sql, args)

    async def get_requests(self, request_ids: list[str]) -> dict[str, ResultDocument]:
        """The stored final results of ``request_ids`` that have completed, by request id."""
        if not request_ids:
            return {}
        ids = list(dict.fromkeys(request_ids))
        marks = ",".join(["%s"] * len(ids))
        rows = await self.query(f"SELECT request_id, document_json FROM requests WHERE request_id IN ({marks})", *ids)
        return {r["request_id"]: ResultDocument.model_validate_json(r["document_json"]) for r in rows}

    async def get_request(self, request_id: str) -> ResultDocument | None:
        """The final result of ``request_id``, or None if it has not completed."""
        rows = await self.query("SELECT document_json FROM requests WHERE request_id = %s", request_id)
        return ResultDocument.model_validate_json(rows[0]["document_json"]) if rows else None
