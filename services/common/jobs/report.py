"""A job's summary report: one row per request (document) of the job, streamed from MariaDB.

Rows come from a server-side cursor (:meth:`services.common.db.Database.stream`) and are written
one at a time to CSV and JSON Lines files on disk, so a 10,000-row report never holds its rows in
memory; only the latencies (one float per row) are kept for the percentiles. The jobs stage writes
the report to S3 at completion (``reports/<job_id>/report.csv``, ``report.jsonl``,
``summary.json``, ``chart.png``); ``ocrstream job report`` writes the same rows locally
(``csv``, ``jsonl``, ``xlsx``). See ``docs/jobs.md``.
"""

from __future__ import annotations

import asyncio
import csv
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

import numpy as np
import orjson

from schemas.jobs import JobSummary
from services.common.db import Database
from services.common.jobs.store import REPORT_SQL, JobRow
from services.common.s3 import ObjectStore
from services.common.wording import plural

#: Per-stage times in the report (keys of ``ResultDocument.timings_ms``, pipeline order), as ``<name>_ms`` columns.
STAGE_TIMES = ("queue_ingest", "ingest", "queue_dedup", "dedup", "queue_infer", "fetch", "decode", "preprocess",
               "engine_wait", "inference", "postprocess", "queue_sink", "write")
BASE_COLUMNS = ("name", "request_id", "status", "error_code", "pages", "lines", "characters", "mean_confidence",
                "cache_hit", "total_ms")
REPORT_PARTS = {"csv": ("report.csv", "text/csv"), "jsonl": ("report.jsonl", "application/x-ndjson"),
                "summary": ("summary.json", "application/json"), "chart": ("chart.png", "image/png")}
"""Report part -> (file name under ``reports/<job_id>/``, content type)."""


def report_key(job_id: str, part: str) -> str:
    """S3 key of one part of a job's report (``part``: a key of :data:`REPORT_PARTS`)."""
    return f"reports/{job_id}/{REPORT_PARTS[part][0]}"


def report_columns(fields: list[str]) -> list[str]:
    """The report's columns: :data:`BASE_COLUMNS`, ``<stage>_ms`` per :data:`STAGE_TIMES`, then
    ``field:<name>`` per ``extract`` field the job asked for."""
    return [*BASE_COLUMNS, *(f"{s}_ms" for s in STAGE_TIMES), *(f"field:{f}" for f in fields)]


def report_record(row: dict, fields: list[str]) -> dict:
    """One ``job_requests`` row (:data:`~services.common.jobs.store.REPORT_SQL`) as a report row, keys in
    :func:`report_columns` order (absent values None; times in ms, rounded to 0.001 ms)."""
    timings = orjson.loads(row["timings_json"]) if row.get("timings_json") else {}
    values = orjson.loads(row["fields_json"]) if row.get("fields_json") else {}
    conf = row.get("mean_confidence")
    out = {"name": row.get("filename"), "request_id": row["request_id"], "status": row["status"],
           "error_code": row.get("error_code"), "pages": row.get("pages"), "lines": row.get("line_count"),
           "characters": row.get("char_count"), "mean_confidence": None if conf is None else round(float(conf), 4),
           "cache_hit": bool(row.get("cache_hit")), "total_ms": row.get("total_ms")}
    out.update({f"{s}_ms": None if timings.get(s) is None else round(float(timings[s]), 3) for s in STAGE_TIMES})
    out.update({f"field:{f}": (values or {}).get(f) for f in fields})
    return out


class SummaryBuilder:
    """Totals over report rows as they stream past (:class:`~schemas.jobs.JobSummary`)."""

    def __init__(self) -> None:
        self.requests = self.hits = self.pages = self.lines = self.chars = 0
        self.engine_ms = 0.0
        self.by_status: dict[str, int] = {}
        self.by_code: dict[str, int] = {}
        self.latencies: list[float] = []  # one float per row: 80 KB for 10,000 rows

    def add(self, rec: dict) -> None:
        """Count one report row (:func:`report_record`)."""
        self.requests += 1
        self.by_status[rec["status"]] = self.by_status.get(rec["status"], 0) + 1
        if rec["error_code"]:
            self.by_code[rec["error_code"]] = self.by_code.get(rec["error_code"], 0) + 1
        self.hits += rec["cache_hit"]
        self.pages += rec["pages"] or 0
        self.lines += rec["lines"] or 0
        self.chars += rec["characters"] or 0
        self.engine_ms += rec["inference_ms"] or 0.0
        if rec["total_ms"] is not None:
            self.latencies.append(float(rec["total_ms"]))

    def summary(self) -> JobSummary:
        """The totals; percentiles by numpy's default (linear interpolation), rounded to 0.1 ms."""
        pct = ({k: round(float(v), 1) for k, v in zip(("p50", "p95", "p99"), np.percentile(self.latencies, [50, 95, 99]))}
               if self.latencies else {})
        return JobSummary(requests=self.requests, by_status=dict(sorted(self.by_status.items())),
                          by_error_code=dict(sorted(self.by_code.items())), latency_ms=pct,
                          engine_ms=round(self.engine_ms, 1),
                          cache_hit_rate=round(self.hits / self.requests, 4) if self.requests else 0.0,
                          pages=self.pages, lines=self.lines, chars=self.chars)


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""A CSV cell whose text starts with one of these is a formula to a spreadsheet (OWASP, "CSV
Injection": ``=HYPERLINK(...)``, ``=cmd|' /C calc'!A0``, ``@SUM(...)``, a tab or CR before one)."""
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def neutral_cell(text: str) -> str:
    """``text`` as a CSV cell no spreadsheet runs as a formula: prefixed with a single quote when
    it starts with one of :data:`FORMULA_STARTS` (OWASP's rule), unless it is a plain number
    (``-12.50``, ``+3``, ``-1,234.5``: no formula, and read as the number it is). The quote shows in
    the cell; JSONL and xlsx keep the value as it is (xlsx cells are text cells)."""
    if text[:1] in FORMULA_STARTS and not _PLAIN_NUMBER.fullmatch(text):
        return "'" + text
    return text


def _csv_cell(v) -> object:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return neutral_cell(v) if isinstance(v, str) else v


def write_rows(rows: Iterable[dict], fields: list[str], sinks: dict[str, IO],
               each: Callable[[dict], None] | None = None) -> int:
    """Write report rows (``job_requests`` dicts) to open text files, one row at a time.

    Args:
        rows: The rows, e.g. a server-side cursor's.
        fields: The job's ``extract`` fields (columns).
        sinks: ``"csv"`` and/or ``"jsonl"`` -> a text file open for writing, with ``newline=""``
            (CSV: RFC 4180, a header row, CRLF line endings, a field holding a comma, a quote, CR
            or LF quoted, ``""`` for None, a text that a spreadsheet would run as a formula
            prefixed with ``'`` (:func:`neutral_cell`); JSONL: one object per line, LF).
        each: Called with every report row (e.g. :meth:`SummaryBuilder.add`, an xlsx sheet's append).

    Returns:
        Rows written.
    """
    cols = report_columns(fields)
    writer = csv.writer(sinks["csv"], lineterminator="\r\n") if "csv" in sinks else None  # RFC 4180
    if writer:
        writer.writerow(cols)
    n = 0
    for row in rows:
        rec = report_record(row, fields)
        if writer:
            writer.writerow([_csv_cell(rec[c]) for c in cols])
        if "jsonl" in sinks:
            sinks["jsonl"].write(orjson.dumps(rec).decode() + "\n")
        if each is not None:
            each({**rec, "inference_ms": row.get("inference_ms")})
        n += 1
    return n


def write_chart(summary: JobSummary, latencies: list[float], path: Path) -> Path:
    """A PNG of the job: requests by status and error code (bars) and the latency histogram with
    p50/p95/p99 marked (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    labels = [*summary.by_status, *(f"error: {c}" for c in summary.by_error_code)]
    counts = [*summary.by_status.values(), *summary.by_error_code.values()]
    ax1.barh(labels or ["none"], counts or [0], color="tab:blue")
    ax1.set_xlabel("requests")
    ax1.set_title(f"{plural(summary.requests, 'request')}, cache hit rate {100 * summary.cache_hit_rate:.1f}%")
    if latencies:
        ax2.hist(latencies, bins=min(50, max(5, len(latencies) // 4)), color="tab:green")
        for q, v in summary.latency_ms.items():
            ax2.axvline(v, linestyle="--", color="gray")
            ax2.text(v, ax2.get_ylim()[1] * 0.95, q, rotation=90, fontsize=7, va="top")
    ax2.set_xlabel("submit-to-completion latency (ms)")
    ax2.set_ylabel("requests")
    ax2.set_title("Latency")
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
    return path


def _rows_to_files(rows: Iterator[dict], fields: list[str], folder: Path) -> tuple[JobSummary, list[float]]:
    acc = SummaryBuilder()
    with open(folder / "report.csv", "w", newline="", encoding="utf-8") as fcsv, \
            open(folder / "report.jsonl", "w", encoding="utf-8") as fjsonl:
        write_rows(rows, fields, {"csv": fcsv, "jsonl": fjsonl}, acc.add)
    return acc.summary(), acc.latencies


async def write_job_report(db: Database, store: ObjectStore, job: JobRow) -> tuple[JobSummary, dict[str, str]]:
    """Write the job's report to S3 (the parts of :data:`REPORT_PARTS` under ``reports/<job_id>/``),
    streamed from MariaDB through files in a temporary folder. Rewriting it gives the same rows.

    Returns:
        The job's totals and part -> ``s3://`` URI.

    Raises:
        pymysql.OperationalError, botocore errors: MariaDB or S3 unreachable (the runner retries).
    """
    fields = job.fields()
    with tempfile.TemporaryDirectory(prefix="ocrstream-report-") as tmp:
        folder = Path(tmp)
        summary, latencies = await db.stream("job_report", REPORT_SQL, (job.job_id,),
                                             lambda rows: _rows_to_files(rows, fields, folder))
        (folder / "summary.json").write_bytes(orjson.dumps(summary.model_dump(), option=orjson.OPT_INDENT_2))
        await asyncio.to_thread(write_chart, summary, latencies, folder / "chart.png")
        uris = {}
        for part, (fname, ctype) in REPORT_PARTS.items():
            await store.put_file(report_key(job.job_id, part), os.fspath(folder / fname), ctype)
            uris[part] = store.uri(report_key(job.job_id, part))
    return summary, uris
