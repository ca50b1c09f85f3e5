"""``ocrstream job status|report``: a job's progress and its summary report, read from MariaDB.

The jobs stage keeps each job in MariaDB (``jobs``, ``job_requests``; ``docs/jobs.md``); these
commands read it there, so they work from any machine that reaches the database, during the job
(a live progress bar; a report of the requests final so far) and after it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from schemas.jobs import JobProgress
from services.cli.options import MAX_WAIT_S, bounded
from services.common.settings import CommonSettings, load_settings
from services.common.wording import plural

job_app = typer.Typer(no_args_is_help=True, help="Read a job's progress and its report.")
console = Console(soft_wrap=True)
err = Console(stderr=True)


def progress_line(p: JobProgress) -> str:
    """One line of a job's counts, e.g. ``closed: 150/200 done, 147 ok, 3 failed (empty_input 1,
    corrupt_image 2), 60 cache hits, 150 pages, 12.5/s, ETA 4 s``."""
    failed = f"{p.failed} failed" + (f" ({', '.join(f'{c} {n}' for c, n in p.failed_by_code.items())})"
                                     if p.failed_by_code else "")
    total = "?" if p.total is None else str(p.total)
    rate = f", {p.rate_per_s:g}/s" if p.rate_per_s else ""
    eta = f", ETA {p.eta_s:.0f} s" if p.eta_s is not None and p.state != "completed" else ""
    return (f"{p.state}: {p.done}/{total} done, {p.ok} ok, {failed}, {plural(p.cache_hits, 'cache hit')}, "
            f"{plural(p.pages, 'page')}{rate}{eta}")


async def _read(job_id: str) -> JobProgress | None:
    from services.common.db import Database
    from services.common.jobs.store import JobStore

    return await JobStore(Database(load_settings(CommonSettings).mysql, pool_size=1)).progress(job_id)


@job_app.command("status")
def status(
    job_id: str = typer.Argument(..., help="The job's id, as `ocrstream submit` prints it."),
    once: bool = typer.Option(False, "--once", help="Print the counts once and exit (without it, a live bar until "
                              "the job completes)."),
    interval: float = bounded(0.5, "--interval", lo=0.05, hi=3600, unit="s",
                              help="How long the live bar waits between two reads of MariaDB"),
    timeout: float = bounded(3600.0, "--timeout", lo=1, hi=MAX_WAIT_S, unit="s",
                             help="How long the live bar waits for the job to complete"),
) -> None:
    """Show a job's progress from MariaDB, as a live bar until it completes.

    The counts: total, done, ok, failed by error code, cache hits, pages, rate and ETA, printed on
    one line at the end.

    Exit codes: 0 the job is completed; 1 it is not (--once, or --timeout passed); 2 no job has
    this id.
    """
    prog = asyncio.run(_read(job_id))
    if prog is None:
        err.print(f"[red]error:[/red] no job {job_id!r} (none of its events or completions recorded yet)")
        raise typer.Exit(2)
    if once:
        console.print(progress_line(prog), highlight=False, markup=False)
        raise typer.Exit(0 if prog.state == "completed" else 1)
    deadline = time.monotonic() + timeout
    with Progress(TextColumn("[bold]job"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
                  TimeElapsedColumn(), TextColumn("{task.description}"), console=err, transient=True) as bar:
        task = bar.add_task("", total=prog.total)
        while True:
            bar.update(task, completed=prog.done, total=prog.total, description=progress_line(prog))
            if prog.state == "completed" or time.monotonic() > deadline:
                break
            time.sleep(interval)
            prog = asyncio.run(_read(job_id)) or prog
    console.print(progress_line(prog), highlight=False, markup=False)
    raise typer.Exit(0 if prog.state == "completed" else 1)


def xlsx_row(ws, values: list) -> list:
    """One sheet row of report values for openpyxl's write-only ``ws.append``: every string is a
    text cell (a value starting with ``=`` stays text, never a formula) with the characters XML
    cannot hold (control characters but tab, LF, CR) replaced by U+FFFD; numbers, booleans and
    None as they are."""
    from openpyxl.cell import WriteOnlyCell
    from openpyxl.cell.cell import ILLEGAL_CHARACTERS_RE

    out = []
    for v in values:
        if isinstance(v, str):
            cell = WriteOnlyCell(ws, value=ILLEGAL_CHARACTERS_RE.sub("\ufffd", v))
            cell.data_type = "s"  # openpyxl would take a leading "=" for a formula
            v = cell
        out.append(v)
    return out


def _write_xlsx(rows, fields: list[str], path: Path) -> int:
    """The report as one sheet (openpyxl write-only mode: rows go to disk as they come); strings
    are text cells (:func:`xlsx_row`)."""
    from openpyxl import Workbook

    from services.common.jobs.report import report_columns, write_rows

    wb = Workbook(write_only=True)
    ws = wb.create_sheet("report")
    cols = report_columns(fields)
    ws.append(xlsx_row(ws, cols))
    n = write_rows(rows, fields, {}, lambda rec: ws.append(xlsx_row(ws, [rec[c] for c in cols])))
    wb.save(path)
    return n


@job_app.command("report")
def report(
    job_id: str = typer.Argument(..., help="The job's id, as `ocrstream submit` prints it."),
    fmt: str = typer.Option("csv", "--format", help="The report's format: csv, jsonl or xlsx."),
    out: Optional[Path] = typer.Option(None, "--out", help="The file to write (by default stdout; xlsx needs one)."),
) -> None:
    """Write a job's report from MariaDB, one row per request.

    The columns: name, request id, status, error code, pages, lines, characters, mean confidence,
    cache hit, the total and per-stage times, and one column per field of an `extract` job. The
    rows are streamed (a server-side cursor), never all in memory. Exit 2 when no job has this id.
    """
    from services.common.db import Database
    from services.common.jobs.report import write_rows
    from services.common.jobs.store import REPORT_SQL, JobStore

    if fmt not in ("csv", "jsonl", "xlsx"):
        err.print(f"[red]error:[/red] --format must be csv, jsonl or xlsx, not {fmt!r}")
        raise typer.Exit(2)
    if fmt == "xlsx" and out is None:
        err.print("[red]error:[/red] --format xlsx needs --out FILE")
        raise typer.Exit(2)
    db = Database(load_settings(CommonSettings).mysql, pool_size=1)

    async def _run() -> int | None:
        job = await JobStore(db).job(job_id)
        if job is None:
            return None
        fields = job.fields()
        if fmt == "xlsx":
            return await db.stream("job_report", REPORT_SQL, (job_id,), lambda rows: _write_xlsx(rows, fields, out))

        def to_text(rows) -> int:
            if out is None:
                return write_rows(rows, fields, {fmt: sys.stdout})
            with open(out, "w", newline="", encoding="utf-8") as f:
                return write_rows(rows, fields, {fmt: f})

        return await db.stream("job_report", REPORT_SQL, (job_id,), to_text)

    n = asyncio.run(_run())
    if n is None:
        err.print(f"[red]error:[/red] no job {job_id!r}")
        raise typer.Exit(2)
    err.print(plural(n, "row") + (f" in {out}" if out else ""), highlight=False)
