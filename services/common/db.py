"""MariaDB/MySQL access (PyMySQL in threads): a connection pool, migrations, queries and transactions."""

from __future__ import annotations

import asyncio
import queue
from contextlib import contextmanager
from importlib import resources

import pymysql

from services.common.settings import MySQLSettings
from services.common.telemetry import Telemetry

# Connection-level failures (PyMySQL CR_* codes): the server went away, so every idle pooled
# connection is likely dead too (a restarted server) and is dropped with the failed one.
_CONNECTION_LOST = frozenset({2003, 2006, 2013, 2055})


class Database:
    """A small pool of PyMySQL connections used from worker threads.

    Connection errors propagate as ``pymysql.OperationalError`` (retriable for the runner);
    the broken connection is dropped and a fresh one is opened on the next call (when the server
    went away, the idle ones are dropped too). The tables' rows are read and written by their
    concepts (requests and results: :mod:`services.common.results.rows`; jobs, documents, keys,
    webhooks: their ``store`` modules).

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

    def _with_cursor(self, fn, args: tuple):
        with self._conn() as conn, conn.cursor() as cur:
            return fn(cur, *args)

    async def with_cursor(self, op: str, fn, *args):
        """Run ``fn(cursor, *args)`` (in a worker thread) on a pooled connection, autocommit: each
        statement commits on its own (:meth:`transact` for statements that commit together); rows
        are tuples. Returns what ``fn`` returns.

        Args:
            op: Operation name for the call-latency metric.
        """
        return await self._run(op, self._with_cursor, fn, args)

    async def execute(self, sql: str, *args) -> int:
        """Run one write statement (autocommit); returns the number of rows it changed.

        Raises:
            pymysql.IntegrityError: a unique key was violated (e.g. a duplicate primary key).
            pymysql.OperationalError: MariaDB unreachable.
        """
        return await self.with_cursor("execute", lambda cur: cur.execute(sql, args))
