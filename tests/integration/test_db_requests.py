"""``ResultRows.write_requests`` on the real MariaDB: one final state per request, returned without a read-back when every row is new."""

from __future__ import annotations

import asyncio
import uuid

from schemas.events import ResultDocument
from services.common.db import Database
from services.common.results.rows import ResultRows
from services.common.settings import CommonSettings
from tests.stack import db_rows


def _doc(rid: str, status: str = "ok", text: str = "") -> ResultDocument:
    return ResultDocument(request_id=rid, status=status, content_sha256="ab" * 32, text=text,
                          submitted_at_ms=1, completed_at_ms=2, timings_ms={"total": 1.0})


def test_first_final_state_is_returned_and_kept():
    async def go():
        db = ResultRows(Database(CommonSettings().mysql, pool_size=1))
        a, b, c = (f"dbw-{uuid.uuid4().hex[:12]}" for _ in range(3))
        # all new: the documents written come back as they are stored
        first = await db.write_requests([_doc(a, text="FIRST A"), _doc(b, text="FIRST B")])
        assert {k: v.text for k, v in first.items()} == {a: "FIRST A", b: "FIRST B"}
        # a replay of a with another state, next to a new request: a keeps its first state
        again = await db.write_requests([_doc(a, status="error", text="SECOND A"), _doc(c, text="FIRST C")])
        assert {k: (v.status, v.text) for k, v in again.items()} == {a: ("ok", "FIRST A"), c: ("ok", "FIRST C")}
        # one request twice in one batch: the first of the two is its final state
        d = f"dbw-{uuid.uuid4().hex[:12]}"
        twice = await db.write_requests([_doc(d, text="ONE"), _doc(d, text="TWO")])
        assert {k: v.text for k, v in twice.items()} == {d: "ONE"}
        assert await db.write_requests([]) == {}
        rows = db_rows("SELECT request_id, status FROM requests WHERE request_id IN (%s,%s,%s,%s) ORDER BY request_id",
                       a, b, c, d)
        assert sorted((r["request_id"], r["status"]) for r in rows) == sorted(
            [(a, "ok"), (b, "ok"), (c, "ok"), (d, "ok")])
        assert (await db.get_requests([a]))[a].text == "FIRST A"

    asyncio.run(go())
