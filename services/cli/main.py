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

from schemas.tasks import TaskError, parse_fields
from services.cli.jobs import job_app
from services.common.settings import CommonSettings, load_settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Streaming OCR over Kafka.")
cache_app = typer.Typer(no_args_is_help=True, help="Manage the result cache.")
app.add_typer(cache_app, name="cache")
keys_app = typer.Typer(no_args_is_help=True, help="Manage the API keys of the HTTP door.")
app.add_typer(keys_app, name="keys")
app.add_typer(job_app, name="job")
console = Console(soft_wrap=True)  # OCR text lines are printed whole, also into a file or pipe (not cut at 80 columns)
err = Console(stderr=True)

STAGES = ("ingest", "dedup", "infer", "sink", "jobs")


@app.command()
def init() -> None:
    """Create the topics, the S3 bucket (with lifecycle rules on its staging and upload prefixes) and the
    MariaDB tables (idempotent). Dedup's inputs and its changelog get the same partition count; the
    changelog is compacted."""
    from botocore.exceptions import ClientError

    from services.common.db import Database
    from services.common.kafka import create_topics
    from services.common.s3 import ObjectStore

    s = load_settings(CommonSettings)

    async def _run() -> None:
        created = await create_topics(s.kafka, s.topics.all(), compacted=s.topics.compacted())
        console.print(f"topics: {'created ' + ', '.join(created) if created else 'all present'} "
                      f"({s.kafka.partitions} partitions each)")
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
                console.print(f"bucket {s.s3.bucket}: lifecycle rule on {prefix} ({days} day{'s' if days > 1 else ''})")
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code not in ("AccessDenied", "NotImplemented"):
                    raise
                err.print(f"[yellow]warning:[/yellow] no lifecycle rule on {prefix} ({code}): {left}")
        applied = await Database(s.mysql, pool_size=1).migrate()
        console.print(f"mariadb: {'applied ' + ', '.join(applied) if applied else 'schema up to date'}")
        from redis.exceptions import RedisError

        from services.common.cache import ResultCache

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
    """What ``init`` says about the result cache: the generation this deployment reads and writes,
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
    lines = [f"cache: results of {', '.join(sorted({f'{e} {m} {r} (preprocessing {p})' for e, m, r, p in mine}))}"
             f" under generation{'s' if len(current) > 1 else ''} "
             f"{', '.join(sorted({g.gen_id for g in current}))}"]
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
    paths: list[Path] = typer.Argument(..., help="image files or folders (folders: every file inside, hidden ones "
                                       "skipped; links to files followed, links to folders not)"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="wait for every result"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for one result JSON per image"),
    timeout: float = typer.Option(600.0, help="seconds to wait for all results"),
    task: str = typer.Option("ocr", help="task (part of the cache key): one of the deployment's OCRSTREAM_TASKS: "
                             "ocr, doc_parse, table, formula, chart, extract, translate (docs/tasks.md)"),
    fields: Optional[str] = typer.Option(
        None, "--fields", help='--task extract: the field names, comma-separated ("invoice number,date,total"; '
        "1 to 50, each at most 100 characters)"),
    to: Optional[str] = typer.Option(None, "--to", help="--task translate: the target language (en, zh, ja, ko, fr, "
                                     "de, es, it, pt, ru, ar, vi, th)"),
    source: str = typer.Option("cli", help="source label (selects the cache TTL)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="do not print the text"),
    job_name: Optional[str] = typer.Option(None, "--name", help="the job's name (default: the first path's name)"),
    priority: Optional[str] = typer.Option(
        None, "--priority", help="the lane the images are read in: interactive (before bulk work) or bulk; default "
        "interactive for one file, bulk for more"),
) -> None:
    """Publish images to ocr.submit as one job (its id printed first: `ocrstream job status ID`,
    `ocrstream job report ID`); with --wait, show progress and print each image's text."""
    from services.cli.client import Submitter
    from services.common.completions import CompletionWatcher

    s = load_settings(CommonSettings)
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
        console.print(f"job {job_id}: {len(subs)} requests (ocrstream job status {job_id})", highlight=False)
        if not watcher:
            for sub in subs:
                console.print(f"{sub.request_id}  {sub.path}")
            return 1 if too_large else 0
        by_id = {sub.request_id: sub for sub in subs}
        if out:
            out.mkdir(parents=True, exist_ok=True)
        failed = 0
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
                what = f"{len(res.lines)} lines" if res.task == "ocr" else res.task
                console.print(f"{head}  {what}, {res.timings_ms.get('total', 0):.0f} ms", highlight=False, markup=False)
                _print_result(res)
        console.print(f"{len(done)}/{len(subs)} completed, {failed} failed or missing"
                      + (f"; results in {out.resolve()}" if out else ""))
        return 0 if failed == 0 and not too_large else 1

    raise typer.Exit(asyncio.run(_run()))


def _files_to_submit(s: CommonSettings, paths: list[Path]) -> tuple[list[Path], dict[Path, int]]:
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


def _task_params(s: CommonSettings, task: str, fields: str | None, to: str | None):
    """``--task``'s parameters from ``--fields`` (comma-separated) and ``--to``, checked as
    ingest checks them (:meth:`CommonSettings.check_task`), before anything is sent.

    Raises:
        typer.Exit: (2) after printing why they are refused (ingest would end each image
            ``invalid_request``).
    """
    given = {"fields": list(parse_fields(fields)) if fields is not None else None, "target_lang": to}
    try:
        return s.check_task(task, {k: v for k, v in given.items() if v is not None} or None)
    except TaskError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
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
        return f"{head}\n   pages {pages}{of} failed (ocrstream status {res.request_id})"
    if res.error is None:
        return f"{head}\n   {res.status} (no error recorded; ocrstream status {res.request_id})"
    return f"{head}\n   error {res.error.code.value}: {safe_text(res.error.message)}"


def _print_result(res) -> None:
    """One finished ok result as a person reads it (:func:`services.cli.render.renderables`):
    ``extract``'s fields as a two-column table (``-`` where absent), ``doc_parse``/``chart``
    Markdown rendered with its HTML tables as tables, ``table``'s HTML as tables, ``formula``'s
    LaTeX and ``translate``'s text as they are, ``ocr``'s lines."""
    from services.cli.render import renderables

    for part in renderables(res):
        console.print(part, highlight=False, markup=False)


@app.command()
def status(request_id: str) -> None:
    """Print the final state of a request from MariaDB (exit 1 if not completed yet). For a
    document (a split PDF or TIFF), first one line of its progress: pages final of all, failed."""
    from services.common.db import Database
    from services.common.documents import progress

    async def _read():
        db = Database(load_settings(CommonSettings).mysql, pool_size=1)
        return await progress(db, request_id), await db.get_request(request_id)

    prog, doc = asyncio.run(_read())
    if prog is not None:
        err.print(prog.line(), highlight=False, markup=False, soft_wrap=True)
    if doc is None:
        err.print(f"{request_id}: not completed (or unknown)")
        raise typer.Exit(1)
    console.print_json(doc.model_dump_json(by_alias=True))


@app.command()
def run(
    infer: int = typer.Option(1, help="infer processes to start"),
    only: Optional[list[str]] = typer.Option(None, help="start only these stages"),
) -> None:
    """Start the stages (ingest, dedup, infer, sink, jobs) as separate processes in this terminal; Ctrl-C stops them cleanly."""
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
    since: str = typer.Option("1h", "--since", help="window start: a duration back (90s, 15m, 1h, 2d) or an ISO time"),
    png: Optional[Path] = typer.Option(None, "--png", help="also write a chart (stage shares, latency histogram)"),
    source: Optional[str] = typer.Option(None, "--source", help="only requests of this source label"),
) -> None:
    """Per-stage p50/p95/p99 and share of total time of the requests completed in a window (MariaDB)."""
    from services.cli.report import load_rows, parse_since, render_table, summarize, write_png
    from services.common.db import Database

    try:
        since_ms = parse_since(since)
    except ValueError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)
    rows = asyncio.run(load_rows(Database(load_settings(CommonSettings).mysql, pool_size=1), since_ms, source))
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
    model: Optional[str] = typer.Option(None, "--model", help="model revision whose entries to delete"),
    generation: Optional[str] = typer.Option(None, "--generation", help="generation id to delete"),
) -> None:
    """Delete the cache entries of one generation (by model revision or generation id) and fence its
    stored results in S3 (``fences/<gen_id>.json``), so neither Redis nor the S3 tier answers from them."""
    from redis.exceptions import RedisError

    from schemas.keys import purge_fence_key
    from services.common.cache import ResultCache
    from services.common.s3 import ObjectStore

    if not model and not generation:
        err.print("error: give --model REV or --generation ID")
        raise typer.Exit(2)
    s = load_settings(CommonSettings)

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
    console.print(f"deleted {deleted} cache entries of {len(gens)} generation{'s' if len(gens) != 1 else ''}; "
                  f"fenced their stored results in S3 ({', '.join(gens)})")


def _key_store():
    from services.common.db import Database
    from services.common.api_keys import KeyStore

    return KeyStore(Database(load_settings(CommonSettings).mysql, pool_size=1))


def _ms_time(ms: int | None) -> str:
    return "" if ms is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + "Z"


@keys_app.command("create")
def keys_create(
    name: str = typer.Option(..., "--name", help="label of the key (who or what uses it)"),
    rate: Optional[float] = typer.Option(None, "--rate", min=0, help="requests/s of this key; 0 = unlimited; "
                                         "default: the door's OCRSTREAM_RATE_LIMIT_PER_S"),
    burst: Optional[int] = typer.Option(None, "--burst", min=1, help="token bucket size; default: OCRSTREAM_RATE_LIMIT_BURST"),
    quota_per_day: Optional[int] = typer.Option(None, "--quota-per-day", min=0, help="submissions per UTC day; "
                                                "0 = none; default: OCRSTREAM_QUOTA_PER_DAY"),
) -> None:
    """Create an API key; prints the key and its webhook secret once (only a hash of the key is stored)."""
    try:
        new = asyncio.run(_key_store().create(name, rate_per_s=rate, burst=burst, quota_per_day=quota_per_day))
    except ValueError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)
    console.print(f"key_id:         {new.key.key_id}", highlight=False)
    console.print(f"api_key:        {new.token}", highlight=False)
    console.print(f"webhook_secret: {new.webhook_secret}", highlight=False)
    err.print("Store both now: the key is not shown again (only its SHA-256 is kept).")


@keys_app.command("revoke")
def keys_revoke(key_id: str = typer.Argument(..., help="id of the key (the part after ocs_)")) -> None:
    """Revoke a key: running doors refuse it within OCRSTREAM_AUTH_CACHE_S seconds (exit 1 if unknown)."""
    key = asyncio.run(_key_store().revoke(key_id))
    if key is None:
        err.print(f"[red]error:[/red] no API key {key_id!r}")
        raise typer.Exit(1)
    console.print(f"revoked {key.key_id} ({key.name}) at {_ms_time(key.revoked_at_ms)}", highlight=False)


@keys_app.command("list")
def keys_list(
    all_: bool = typer.Option(True, "--all/--active", help="include revoked keys"),
) -> None:
    """List the API keys: id, name, limits, created, revoked (never a key or a secret)."""
    from rich.table import Table

    keys = asyncio.run(_key_store().list(include_revoked=all_))
    dflt = "default"
    table = Table("key_id", "name", "rate/s", "burst", "quota/day", "created (UTC)", "revoked (UTC)")
    for k in keys:
        table.add_row(k.key_id, k.name, dflt if k.rate_per_s is None else f"{k.rate_per_s:g}",
                      dflt if k.burst is None else str(k.burst),
                      dflt if k.quota_per_day is None else str(k.quota_per_day),
                      _ms_time(k.created_at_ms), _ms_time(k.revoked_at_ms))
    console.print(table)


def main() -> None:
    """Console-script entry point."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
