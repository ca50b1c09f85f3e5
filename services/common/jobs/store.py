"""Jobs in MariaDB (``jobs``, ``job_requests``; migration 008): what the jobs stage writes and
what the doors read (a job's progress, its report rows). See ``docs/jobs.md``.

Every write is idempotent: a job's control state takes its first value (a replayed create or
close changes nothing), a request's row in its job is inserted once (``INSERT IGNORE``: a
request completed twice counts once), and the completion event is stored once
(``UPDATE ... WHERE completion_json IS NULL``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import orjson

from schemas.events import ResultDocument
from schemas.jobs import JobEvent, JobProgress
from services.common.db import Database

_CREATE = """
INSERT INTO jobs (job_id, name, task, task_params_json, webhook_url, api_key_id, created_at_ms)
VALUES (%s,%s,%s,%s,%s,%s,%s)
ON DUPLICATE KEY UPDATE name = COALESCE(name, VALUES(name)), task = COALESCE(task, VALUES(task)),
  task_params_json = COALESCE(task_params_json, VALUES(task_params_json)),
  webhook_url = COALESCE(webhook_url, VALUES(webhook_url)), api_key_id = COALESCE(api_key_id, VALUES(api_key_id)),
  created_at_ms = COALESCE(created_at_ms, VALUES(created_at_ms))
"""
_CLOSE = """
INSERT INTO jobs (job_id, expected, closed_at_ms) VALUES (%s,%s,%s)
ON DUPLICATE KEY UPDATE closed_at_ms = IF(expected IS NULL, VALUES(closed_at_ms), closed_at_ms),
  expected = COALESCE(expected, VALUES(expected))
"""
_SEEN = "INSERT IGNORE INTO jobs (job_id) VALUES (%s)"
_REQUEST = """
INSERT IGNORE INTO job_requests (job_id, request_id, status, error_code, cache_hit, pages, line_count, char_count,
  mean_confidence, filename, total_ms, inference_ms, timings_json, fields_json, submitted_at_ms, completed_at_ms)
VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)
"""
_JOB_COLUMNS = ("job_id, name, task, task_params_json, webhook_url, api_key_id, created_at_ms, expected, closed_at_ms, "
                "completed_at_ms, completion_json, completion_sent")
#: The report's row source, in completion order (``seq``).
REPORT_SQL = ("SELECT request_id, filename, status, error_code, pages, line_count, char_count, mean_confidence, "
              "cache_hit, total_ms, inference_ms, timings_json, fields_json, submitted_at_ms, completed_at_ms "
              "FROM job_requests WHERE job_id = %s ORDER BY seq")


def is_page(doc: ResultDocument) -> bool:
    """Whether ``doc`` is one page of a document (``page_number`` set): jobs count documents, not
    pages (``docs/jobs.md``)."""
    return doc.page_number is not None


def request_row(doc: ResultDocument) -> tuple:
    """The ``job_requests`` row of a final result (``doc.job_id`` set).

    ``pages``: the document's ``page_count`` when it has one, else its pages (at least 1);
    ``char_count``: characters of ``text``; ``mean_confidence``: the mean of its lines'
    confidences (None without lines, e.g. an error or a row whose lines were left out).
    """
    conf = [ln.confidence for ln in doc.lines]
    pages = doc.page_count or len(doc.pages) or 1
    return (
        doc.job_id, doc.request_id, doc.status, doc.error.code.value if doc.error else None, int(doc.cache_hit),
        pages, len(doc.lines) + doc.lines_omitted, len(doc.text), sum(conf) / len(conf) if conf else None,
        (doc.filename or "")[:512] or None, doc.timings_ms.get("total"), doc.timings_ms.get("inference"),
        orjson.dumps(doc.timings_ms).decode(), orjson.dumps(doc.fields).decode() if doc.fields is not None else None,
        doc.submitted_at_ms, doc.completed_at_ms or 0,
    )


@dataclass(frozen=True)
class JobRow:
    """A ``jobs`` row (see migration 008 for the columns)."""

    job_id: str
    name: str | None
    task: str | None
    task_params_json: str | None
    webhook_url: str | None
    api_key_id: str | None
    created_at_ms: int | None
    expected: int | None
    closed_at_ms: int | None
    completed_at_ms: int | None
    completion_json: str | None
    completion_sent: int

    def fields(self) -> list[str]:
        """The ``extract`` field names the job asked for (its report's columns), else []."""
        params = orjson.loads(self.task_params_json) if self.task_params_json else None
        return list((params or {}).get("fields") or [])


class JobStore:
    """The jobs tables over a :class:`~services.common.db.Database`.

    Raises (every method): ``pymysql.OperationalError`` when MariaDB does not answer (an outage
    the runner retries).
    """

    def __init__(self, db: Database):
        self.db = db

    @staticmethod
    def _record(cur, events: list[JobEvent], docs: list[ResultDocument]) -> None:
        for ev in events:
            if ev.action == "create":
                params = ev.task_params.model_dump_json(exclude_none=True) if ev.task_params else None
                cur.execute(_CREATE, (ev.job_id, ev.name, ev.task, params, ev.webhook_url, ev.api_key_id, ev.at_ms))
            else:
                cur.execute(_CLOSE, (ev.job_id, ev.expected, ev.at_ms))
        if docs:
            cur.executemany(_SEEN, [(j,) for j in sorted({d.job_id for d in docs})])
            cur.executemany(_REQUEST, [request_row(d) for d in docs])

    async def record(self, events: list[JobEvent], docs: list[ResultDocument]) -> None:
        """Apply control events (in order) and insert the final requests of ``docs`` (each with a
        ``job_id``), in one transaction. A request already in its job keeps its first row."""
        await self.db.transact("jobs_record", self._record, events, docs)

    async def job(self, job_id: str) -> JobRow | None:
        """The job's row, or None when no event or completion of it has been recorded."""
        rows = await self.db.query(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE job_id = %s", job_id)
        return JobRow(**rows[0]) if rows else None

    async def final_count(self, job_id: str) -> int:
        """Final requests recorded for the job."""
        rows = await self.db.query("SELECT COUNT(*) AS n FROM job_requests WHERE job_id = %s", job_id)
        return int(rows[0]["n"])

    async def progress(self, job_id: str, now_ms: int | None = None) -> JobProgress | None:
        """The job's progress from its rows (one aggregate query over ``job_requests``), or None
        for an unknown job. ``now_ms`` is not read: rate and ETA use recorded times only, so the
        progress of a finished job is the same whenever it is read."""
        job = await self.job(job_id)
        if job is None:
            return None
        rows = await self.db.query(
            "SELECT status, error_code, COUNT(*) AS n, SUM(cache_hit) AS hits, SUM(pages) AS pages, "
            "SUM(line_count) AS line_count, SUM(char_count) AS chars, MIN(completed_at_ms) AS first, "
            "MAX(completed_at_ms) AS last FROM job_requests WHERE job_id = %s GROUP BY status, error_code", job_id)
        return progress_of(job, rows)

    async def store_completion(self, job_id: str, raw: bytes, completed_at_ms: int) -> str:
        """Store the job's completion event unless one is stored; returns the stored one (text)."""
        def tx(cur) -> str:
            cur.execute("UPDATE jobs SET completion_json = %s, completed_at_ms = %s "
                        "WHERE job_id = %s AND completion_json IS NULL", (raw.decode(), completed_at_ms, job_id))
            cur.execute("SELECT completion_json FROM jobs WHERE job_id = %s", (job_id,))
            return cur.fetchone()["completion_json"]

        return await self.db.transact("jobs_store_completion", tx)

    async def mark_sent(self, job_ids: Iterable[str]) -> None:
        """Mark the jobs' completion events acknowledged by Kafka (not sent again in the normal case)."""
        ids = sorted(set(job_ids))
        if ids:
            marks = ",".join(["%s"] * len(ids))
            await self.db.execute(f"UPDATE jobs SET completion_sent = 1 WHERE job_id IN ({marks})", *ids)


def progress_of(job: JobRow, groups: list[dict]) -> JobProgress:
    """A :class:`JobProgress` from the job's row and its ``job_requests`` aggregate per
    ``(status, error_code)``. Rate: ``done`` over the span from the job's creation (else its
    first completion) to its last completion; ETA: the rest at that rate."""
    done = ok = failed = hits = pages = lines = chars = 0
    by_code: dict[str, int] = {}
    first = last = None
    for g in groups:
        n = int(g["n"])
        done += n
        if g["status"] == "ok":
            ok += n
        else:
            failed += n
            code = g["error_code"] or g["status"]
            by_code[code] = by_code.get(code, 0) + n
        hits, pages = hits + int(g["hits"] or 0), pages + int(g["pages"] or 0)
        lines, chars = lines + int(g["line_count"] or 0), chars + int(g["chars"] or 0)
        first = g["first"] if first is None else min(first, g["first"])
        last = g["last"] if last is None else max(last, g["last"])
    completed = job.completion_json is not None
    state = "completed" if completed else ("closed" if job.expected is not None else "open")
    start = job.created_at_ms if job.created_at_ms is not None else first
    rate = eta = None
    if done and start is not None and last is not None and last > start:
        rate = round(done / ((last - start) / 1000), 3)
    if completed:
        eta = 0.0
    elif rate and job.expected is not None:
        eta = round(max(0, job.expected - done) / rate, 1)
    return JobProgress(
        job_id=job.job_id, name=job.name, task=job.task, state=state, total=job.expected, done=done, ok=ok,
        failed=failed, failed_by_code=dict(sorted(by_code.items())), cache_hits=hits, pages=pages, lines=lines,
        chars=chars, created_at_ms=job.created_at_ms, closed_at_ms=job.closed_at_ms, first_completed_at_ms=first,
        last_completed_at_ms=last, completed_at_ms=job.completed_at_ms, rate_per_s=rate, eta_s=eta,
    )
