"""``ocrstream``: init the stack, submit images and wait for results, run the stages, manage the cache."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import orjson
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from schemas.tasks import TaskError, UnsupportedTask, parse_fields
from services.cli.helptext import whole_paragraphs
from services.cli.jobs import job_app
from services.cli.keys import keys_app
from services.cli.options import MAX_WAIT_S, bounded
from services.common.cache.keys import CacheKeySettings
from services.common.settings import load_settings
from services.common.wording import plural

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Streaming OCR over Kafka: submit images and documents, read their results, run the stages.")
cache_app = typer.Typer(no_args_is_help=True, help="Manage the result cache.")
app.add_typer(cache_app, name="cache")
app.add_typer(keys_app, name="keys")
app.add_typer(job_app, name="job")
console = Console(soft_wrap=True)  # OCR text lines are printed whole, also into a file or pipe (not cut at 80 columns)
err = Console(stderr=True)

STAGES = ("ingest", "dedup", "infer", "sink", "jobs", "webhooks")


@app.command()
def init() -> None:
    """Create the topics, the S3 bucket and the MariaDB tables (idempotent).

    The bucket gets lifecycle rules on its staging and upload prefixes. Dedup's inputs and its
    changelog get the same partition count; the changelog is compacted.
    """
    from botocore.exceptions import ClientError

    from services.common.db import Database
    from services.common.kafka import create_topics
    from services.common.s3 import ObjectStore

    s = load_settings(CacheKeySettings)

    async def _run() -> None:
        created = await create_topics(s.kafka, s.topics.all(), compacted=s.topics.compacted())
        console.print(f"topics: {'created ' + ', '.join(created) if created else 'all present'} "
                      f"({plural(s.kafka.partitions, 'partition')} each)")
        store = ObjectStore(s.s3)
        made = await store.ensure_bucket()
        console.print(f"bucket {s.s3.bucket}: {'created' if made else 'present'}")
        # what a door killed mid-upload leaves under the staging prefix goes after a day; what
        # `ocrstream submit` uploads for ingest to read goes after upload_expiry_days, accepted or not
        rules = ((store.ensure_staging_lifecycle, s.s3.staging_prefix, 1,
                  "parts of uploads cut off by a killed HTTP door stay until removed by hand"),
                 (store.ensure_upload_lifecycle, s.s3.upload_prefix, s.s3.upload_expiry_days,
                  "files `ocrstream submit` uploaded stay until removed by hand"))
        for ensure, prefix, days, left in rules:
            try:
                await ensure(days=days)
                console.print(f"bucket {s.s3.bucket}: lifecycle rule on {prefix} ({plural(days, 'day')})")
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code not in ("AccessDenied", "NotImplemented"):
                    raise
                err.print(f"[yellow]warning:[/yellow] no lifecycle rule on {prefix} ({code}): {left}")
        applied = await Database(s.mysql, pool_size=1).migrate()
        console.print(f"mariadb: {'applied ' + ', '.join(applied) if applied else 'schema up to date'}")
        from redis.exceptions import RedisError

        from services.common.cache.entries import ResultCache

        cache = ResultCache(s.redis.model_copy(update={"timeout_ms": max(s.redis.timeout_ms, 5000)}))
        try:
            known = await cache.generations()
        except (RedisError, OSError) as exc:  # Redis is only a cache: init's work is done
            err.print(f"[yellow]warning:[/yellow] Redis (OCRSTREAM_REDIS__URL) did not answer ({exc}): "
                      "cache generations of other settings not checked")
            return
        finally:
            await cache.close()
        for line in generation_report([s.generation(t) for t in s.tasks], known):
            console.print(escape(line))

    asyncio.run(_run())


def generation_report(current: list, known: dict) -> list[str]:
    """What ``init`` says about the result cache: the generations this deployment reads and writes (one per task),
    and the generations of other settings (another engine, model, model revision or preprocessing
    version: results of an engine before an upgrade) that Redis still holds, never served again,
    with the ``cache purge`` that frees them.

    Args:
        current: This deployment's generations (:class:`~schemas.keys.CacheGeneration`), one per task.
        known: Every generation registered in Redis, by id (:meth:`ResultCache.generations`).
    """
    def ident(g) -> tuple:  # what a generation reads with, whatever the task or request options
        return g.engine, g.model, g.model_revision, g.preprocess_version

    mine = {ident(g) for g in current}
    revisions = {g.model_revision for g in current}
    per_task = {g.gen_id: g.task for g in current}  # one generation per task (schemas.tasks.task_variant)
    lines = [f"cache: results of {', '.join(sorted({f'{e} {m} {r} (preprocessing {p})' for e, m, r, p in mine}))}"
             f" under generation{'s' if len(per_task) > 1 else ''} "
             f"{', '.join(f'{gid} ({task})' for gid, task in per_task.items())}"
             f"{', one per task' if len(per_task) > 1 else ''}"]
    old: dict[tuple, list[str]] = {}
    for gid, g in known.items():
        if ident(g) not in mine:
            old.setdefault(ident(g), []).append(gid)
    for (engine, model, rev, pre), ids in sorted(old.items()):
        purge = (f"ocrstream cache purge --model {rev}" if rev not in revisions else
                 " && ".join(f"ocrstream cache purge --generation {i}" for i in sorted(ids)))
        lines.append(f"cache: {len(ids)} generation{'s' if len(ids) > 1 else ''} of {engine} {model} {rev} "
                     f"(preprocessing {pre}) still in Redis, never served by these settings: "
                     f"every image is read again on its first request; free them with `{purge}`")
    return lines


@app.command()
def submit(
    paths: list[Path] = typer.Argument(..., help="Image or document files, or folders: every file inside, hidden "
                                       "ones skipped, links to files followed, links to folders not."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for every result and print it (--no-wait: print "
                              "each file's request id and return at once)."),
    out: Optional[Path] = typer.Option(None, "--out", help="A folder to write each whole result document to, as JSON."),
    timeout: float = bounded(600.0, "--timeout", lo=1, hi=MAX_WAIT_S, unit="s",
                             help="How long --wait waits for all the results"),
    task: str = typer.Option("ocr", help="The task (part of the cache key): ocr, doc_parse, table, formula, chart, extract or "
                             "translate, of those the configured engine can do (the CPU engine: ocr, doc_parse, "
                             "table; docs/tasks.md)."),
    fields: Optional[str] = typer.Option(
        None, "--fields", help='For --task extract, the field names, comma-separated ("invoice number,date,total"; '
        "1 to 50, each at most 100 characters)."),
    to: Optional[str] = typer.Option(None, "--to", help="For --task translate, the target language (en, zh, ja, ko, "
                                     "fr, de, es, it, pt, ru, ar, vi, th)."),
    source: str = typer.Option("cli", help="The source label (it selects the cache TTL)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the results that are not ok (without "
                               "their text) and the closing count."),
    job_name: Optional[str] = typer.Option(None, "--name", help="The job's name (by default the first path's name)."),
    priority: Optional[str] = typer.Option(
        None, "--priority", help="The lane the images are read in: interactive (before bulk work) or bulk; by default "
        "interactive for one file, bulk for more."),
) -> None:
    """Publish images and documents to ocr.submit as one job, and wait for their results.

    The job's id is printed first (`ocrstream job status ID`, `ocrstream job report ID`). With
    --wait (the default), a progress bar is shown and each image's result is printed as a person
    reads it; with --no-wait, one `request-id  path` line per file.

    Exit codes: 0 every result ok; 1 one failed, is partial, did not come within --timeout, or a
    file was over the size limit (not sent); 2 a refused option, a missing path or no file.
    """
    from services.cli.client import Submitter
    from services.common.results.completions import CompletionWatcher

    s = load_settings(CacheKeySettings)
    for name, value in (("--task", task), ("--source", source)):
        if not 1 <= len(value) <= 64:  # the limits of the submit event (schemas/events.py)
            err.print(f"[red]error:[/red] {name} must be 1 to 64 characters, not {len(value)}")
            raise typer.Exit(2)
    params = _task_params(s, task, fields, to)
    if priority not in (None, "interactive", "bulk"):
        err.print(f"[red]error:[/red] --priority must be interactive or bulk, not {priority!r}")
        raise typer.Exit(2)
    files, too_large = _files_to_submit(s, paths)
    lane = priority or ("interactive" if len(files) == 1 else "bulk")

    async def _run() -> int:
        watcher = CompletionWatcher(s) if wait else None
        submitter = Submitter(s)
        if watcher:
            await watcher.start()
        await submitter.start()
        try:
            job_id, subs = await _submit_job(submitter, files, job_name or paths[0].resolve().name, task, source, params,
                                             lane)
        finally:
            await submitter.stop()
        console.print(f"job {job_id}: {plural(len(subs), 'request')} (ocrstream job status {job_id})", highlight=False)
        if not watcher:
            for sub in subs:
                console.print(f"{sub.request_id}  {sub.path}")
            return 1 if too_large else 0
        by_id = {sub.request_id: sub for sub in subs}
        if out:
            out.mkdir(parents=True, exist_ok=True)
        done: dict[str, object] = {}
        try:
            with Progress(TextColumn("[bold]OCR"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=err, transient=True) as bar:
                job = bar.add_task("ocr", total=len(subs))

                async def collect() -> None:
                    async for ev in watcher.completions(set(by_id)):
                        done[ev.request_id] = ev.result
                        bar.advance(job)

                await asyncio.wait_for(collect(), timeout)
        except asyncio.TimeoutError:
            err.print(f"[red]timed out[/red] after {timeout:.0f}s: {len(subs) - len(done)} of {len(subs)} not completed")
        finally:
            await watcher.stop()
        failed = _print_outcomes(subs, done, out, quiet)
        console.print(f"{len(done)}/{len(subs)} completed, {failed} failed or missing"
                      + (f"; results in {out.resolve()}" if out else ""))
        return 0 if failed == 0 and not too_large else 1

    raise typer.Exit(asyncio.run(_run()))


def _print_outcomes(subs: list, done: dict, out: Optional[Path], quiet: bool) -> int:
    """Print each submitted file's result in submit order, and write it to ``out`` when given.

    ``subs`` are the submissions (``.request_id``, ``.path``); ``done`` maps a request id to its
    :class:`ResultDocument` (absent: it did not come in time). Each result is written as
    ``<stem>.<first 8 of the id>.json`` (indented JSON) under ``out``. A result not ``ok`` is
    printed as :func:`failure_lines` (a partial one then with the text of its good pages); an ``ok``
    one as its head line and its text, unless ``quiet``.

    Returns:
        The number of files without an ``ok`` result (failed, partial or missing).
    """
    failed = 0
    for sub in subs:
        res = done.get(sub.request_id)
        if res is None:
            failed += 1
            continue
        if out:
            (out / f"{sub.path.stem}.{sub.request_id[:8]}.json").write_bytes(
                orjson.dumps(res.model_dump(mode="json", by_alias=True), option=orjson.OPT_INDENT_2))
        head = f"== {sub.path.name}  [{res.status}{' cache hit' if res.cache_hit else ''}]  {sub.request_id}"
        if res.status != "ok":
            failed += 1
            console.print(failure_lines(head, res), highlight=False, markup=False)
            if res.status == "partial" and not quiet:
                _print_result(res)  # the text of the pages that did not fail
        elif not quiet:
            what = plural(len(res.lines), "line") if res.task == "ocr" else res.task
            console.print(f"{head}  {what}, {res.timings_ms.get('total', 0):.0f} ms", highlight=False, markup=False)
            _print_result(res)
    return failed


def _files_to_submit(s: CacheKeySettings, paths: list[Path]) -> tuple[list[Path], dict[Path, int]]:
    """The files under ``paths`` to submit, and those over ``limits.max_image_bytes`` (path -> size),
    each printed as refused here, before anything is read, sent or uploaded (ingest would refuse them).

    Raises:
        typer.Exit: 2 when a path is missing or there is no file, 1 when every file is too large.
    """
    from services.cli.client import collect_files

    try:
        files = collect_files(paths)
    except FileNotFoundError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)
    if not files:
        err.print("[red]error:[/red] no image files found")
        raise typer.Exit(2)
    limit = s.limits.max_image_bytes
    too_large = {f: size for f in files if (size := f.stat().st_size) > limit}
    for f, size in too_large.items():
        err.print(f"[red]error:[/red] {escape(str(f))}: {size} bytes, over the limit of {limit} bytes "
                  "(OCRSTREAM_LIMITS__MAX_IMAGE_BYTES): input_too_large, not submitted, nothing uploaded",
                  highlight=False)
    files = [f for f in files if f not in too_large]
    if not files:
        raise typer.Exit(1)
    return files, too_large


async def _submit_job(submitter, files: list[Path], name: str, task: str, source: str, params, priority: str):
    """Create a job (``ocr.jobs`` create), submit ``files`` in it (in lane ``priority``), close it
    with their count.

    Returns:
        ``(job_id, submissions)``; the job id is a new 32-hex-digit id.
    """
    import uuid

    from schemas.jobs import JobEvent

    job_id = uuid.uuid4().hex
    await submitter.job_event(JobEvent(action="create", job_id=job_id, name=name[:256], task=task, task_params=params))
    subs = await submitter.submit_files(files, task=task, source=source, task_params=params, job_id=job_id,
                                        priority=priority)
    await submitter.job_event(JobEvent(action="close", job_id=job_id, expected=len(subs)))
    return job_id, subs


def _task_params(s: CacheKeySettings, task: str, fields: str | None, to: str | None):
    """``--task``'s parameters from ``--fields`` (comma-separated) and ``--to``, checked as
    ingest checks them (:meth:`CacheKeySettings.check_task`), and the task against the deployment's
    engine as the HTTP door checks it, before anything is sent.

    Raises:
        typer.Exit: (2) after printing why they are refused (ingest would end each image
            ``invalid_request``; a task the engine cannot do: ``unsupported_task`` and the
            door's message, infer would end each image so).
    """
    given = {"fields": list(parse_fields(fields)) if fields is not None else None, "target_lang": to}
    try:
        return s.check_task(task, {k: v for k, v in given.items() if v is not None} or None, engine=True)
    except TaskError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2) from None
    except UnsupportedTask as exc:  # one line, whatever the terminal's width: the door's code and message
        err.print(f"[red]error:[/red] unsupported_task: {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def failure_lines(head: str, res) -> str:
    """What ``submit`` prints for a result that is not ``ok``: ``head``, then on the next line
    for ``error`` its code and message (through :func:`services.cli.render.safe_text`: the
    message may quote a server's answer), for a ``partial`` document (some pages failed, which
    carries no ``error``) its failed pages, e.g. ``   pages 2, 5 of 7 failed (ocrstream status ID)``.

    Args:
        head: The result's first line (``== name  [status]  request-id``).
        res: A :class:`~schemas.events.ResultDocument` whose status is ``error`` or ``partial``.
    """
    from services.cli.render import safe_text

    if res.status == "partial":
        pages = ", ".join(str(n) for n in res.failed_pages)
        of = f" of {res.page_count}" if res.page_count else ""
        noun = plural(len(res.failed_pages), "page", number=False)
        return f"{head}\n   {noun} {pages}{of} failed (ocrstream status {res.request_id})"
    if res.error is None:
        return f"{head}\n   {res.status} (no error recorded; ocrstream status {res.request_id})"
    return f"{head}\n   error {res.error.code.value}: {safe_text(res.error.message)}"


def _print_result(res) -> None:
    """One finished ok result (or a partial one: the pages that did not fail) as a person reads it
    (:func:`services.cli.render.renderables`): ``extract``'s fields as a two-column table (``-``
    where absent), ``doc_parse``/``chart`` Markdown rendered with its HTML tables as tables,
    ``table``'s HTML as tables, ``formula``'s LaTeX and ``translate``'s text as they are, ``ocr``'s
    lines. Prints to the console; returns nothing."""
    from services.cli.render import renderables

    for part in renderables(res):
        console.print(part, highlight=False, markup=False)


@app.command()
def status(
    request_id: str = typer.Argument(..., help="The request's id, as `ocrstream submit --no-wait` prints it, or a "
                                     "document's page, `<document id>:p<n>`."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole stored result document instead, as one "
                                 "line of JSON (for jq)."),
) -> None:
    """Print one request's state: its result as a person reads it, or tell pending from unknown.

    A final request prints its status, error, task, line count and timings, then its text or the
    task's answer as `ocrstream submit` shows it. For a document (a split PDF or TIFF), one line of
    its pages' progress comes first, on stderr.

    Exit codes: 0 ok; 1 error or partial; 2 no request has this id; 3 pending (accepted, not final
    yet); 4 a store did not answer, so the state cannot be told.
    """
    from services.cli import status as st

    look = asyncio.run(st.look_up(load_settings(CacheKeySettings), request_id))
    if look.progress is not None:
        err.print(look.progress.line(), highlight=False, markup=False, soft_wrap=True)
    doc = look.doc
    if doc is None:
        err.print(st.not_final_line(request_id, look), highlight=False, markup=False, soft_wrap=True)
    elif as_json:
        sys.stdout.write(doc.model_dump_json(by_alias=True) + "\n")
    else:
        console.print("\n".join(st.summary_lines(doc)), highlight=False, markup=False)
        if doc.status != "error":
            console.print()
            _print_result(doc)
    raise typer.Exit(st.exit_code(look))


@app.command()
def run(
    infer: int = bounded(1, "--infer", kind=int, lo=1, hi=64, help="How many infer processes to start"),
    only: Optional[list[str]] = typer.Option(None, help="Start only this stage (repeat it for more: --only ingest "
                                             "--only sink)."),
) -> None:
    """Run the stages (ingest, dedup, infer, sink, jobs, webhooks) as separate processes in this terminal.

    Ctrl-C stops them cleanly; when one stage exits, the others are stopped too.
    """
    stages = [st for st in STAGES if not only or st in only]
    procs: list[tuple[str, subprocess.Popen]] = []
    for st in stages:
        for i in range(infer if st == "infer" else 1):
            procs.append((st if i == 0 else f"{st}-{i}",
                          subprocess.Popen([sys.executable, "-m", f"services.{st}"], start_new_session=True)))
            console.print(f"started {st} (pid {procs[-1][1].pid})")
    stopping = False

    def _stop(*_):
        nonlocal stopping
        if not stopping:
            stopping = True
            err.print("stopping stages ...")
            for _, p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        while any(p.poll() is None for _, p in procs):
            time.sleep(0.2)
            if not stopping and any(p.poll() is not None for _, p in procs):
                dead = [n for n, p in procs if p.poll() is not None]
                err.print(f"[red]stage exited:[/red] {', '.join(dead)}; stopping the others")
                _stop()
    finally:
        deadline = time.time() + 30
        for _, p in procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
    codes = [p.returncode for _, p in procs]
    raise typer.Exit(0 if stopping and all(c in (0, -signal.SIGTERM) for c in codes) else 1)


@app.command()
def report(
    since: str = typer.Option("1h", "--since", help="The window's start: a duration back (90s, 15m, 1h, 2d) or an "
                              "ISO time."),
    png: Optional[Path] = typer.Option(None, "--png", help="Also write a chart to this file (stage shares, latency "
                                       "histogram)."),
    source: Optional[str] = typer.Option(None, "--source", help="Only the requests of this source label."),
) -> None:
    """Print each stage's latency percentiles and share of the time, over a window of requests.

    The requests are those completed in the window, read from MariaDB; each stage gets its p50,
    p95, p99 and mean in ms and its share of the total time. Exit 1 when no request completed in
    the window. For a job's rows, use `ocrstream job report`.
    """
    from services.cli.report import load_rows, parse_since, render_table, summarize, write_png
    from services.common.db import Database

    try:
        since_ms = parse_since(since)
    except ValueError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)
    rows = asyncio.run(load_rows(Database(load_settings(CacheKeySettings).mysql, pool_size=1), since_ms, source))
    rep = summarize(rows, since_ms)
    console.print(render_table(rep))
    if png:
        console.print(f"chart: {write_png(rep, png)}")
    if not rep.requests:
        raise typer.Exit(1)


PURGE_TIMEOUT_MS = 30_000
"""Socket timeout of each Redis call of ``cache purge``, ms (the stages use ``redis.timeout_ms``)."""


@cache_app.command("purge")
def cache_purge(
    model: Optional[str] = typer.Option(None, "--model", help="The model revision whose entries to delete."),
    generation: Optional[str] = typer.Option(None, "--generation", help="The generation id whose entries to delete."),
) -> None:
    """Delete the cache entries of one generation, named by its model revision or its id.

    Its stored results in S3 are fenced too (fences/<gen_id>.json), so neither Redis nor the S3
    tier answers from them. Exit 1 when no generation has that model revision or id.
    """
    from redis.exceptions import RedisError

    from schemas.keys import purge_fence_key
    from services.common.cache.entries import ResultCache
    from services.common.s3 import ObjectStore

    if not model and not generation:
        err.print("error: give --model REV or --generation ID")
        raise typer.Exit(2)
    s = load_settings(CacheKeySettings)

    async def _run() -> tuple[list[str], int, BaseException | None]:
        # an operator's command scanning the whole keyspace: the stages' 100 ms per-call budget would
        # make a loaded Redis (or a loaded machine) fail it half way, so it waits up to 30 s per call
        cache = ResultCache(s.redis.model_copy(update={"timeout_ms": max(s.redis.timeout_ms, PURGE_TIMEOUT_MS)}))
        gens: list[str] = []
        deleted, failed = 0, None
        try:
            gens, deleted = await cache.purge(model_revision=model, gen_id=generation)
        except (RedisError, OSError) as exc:  # the S3 fences are still written: Redis is only a cache
            failed = exc
        finally:
            await cache.close()
        # generations Redis does not know (flushed, or down): the id given, or this deployment's own
        known = {generation} if generation else {s.generation(t).gen_id for t in s.tasks
                                                 if s.generation(t).model_revision == model}
        gens = sorted(set(gens) | known)
        store = ObjectStore(s.s3)
        fence = orjson.dumps({"purged_at_ms": int(time.time() * 1000)})
        for gid in gens:
            await store.put(purge_fence_key(gid), fence, "application/json")
        return gens, deleted, failed

    gens, deleted, failed = asyncio.run(_run())
    if failed is not None:
        err.print(f"warning: Redis (OCRSTREAM_REDIS__URL) did not answer the purge ({failed}); its entries expire "
                  "with their TTL")
    if not gens:
        err.print(f"error: no cache generation has {'model revision ' + repr(model) if model else 'id ' + repr(generation)}"
                  " (generations are registered by dedup; see `ocrstream cache purge --help`)")
        raise typer.Exit(1)
    console.print(f"deleted {plural(deleted, 'cache entry', 'cache entries')} of {plural(len(gens), 'generation')}; "
                  f"fenced their stored results in S3 ({', '.join(gens)})")


whole_paragraphs(app)  # after every command is registered: help read as whole sentences


def main() -> None:
    """Console-script entry point."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
