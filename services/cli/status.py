"""``ocrstream status``: one request's state, read as a person reads it or as one line of JSON.

A final request is read from MariaDB (``requests.document_json``); one without a final state is
told apart as pending or unknown by :mod:`services.common.requests.acceptance`, the same rule as the HTTP
door's. The exit code says which (:data:`EXIT_CODES`, the table in ``docs/cli.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pymysql

from schemas.events import ResultDocument
from services.cli.render import safe_text
from services.cli.report import STAGES
from services.common.requests.acceptance import Accepted
from services.common.documents.state import Progress
from services.common.settings import CommonSettings
from services.common.wording import plural

EXIT_OK = 0
"""Final and ``ok``."""
EXIT_FAILED = 1
"""Final and not ``ok``: ``error``, or a ``partial`` document (as ``submit`` counts them)."""
EXIT_UNKNOWN = 2
"""No request has this id (as ``job status`` and ``job report`` for an unknown job)."""
EXIT_PENDING = 3
"""Accepted, not final yet: ask again later."""
EXIT_UNAVAILABLE = 4
"""A store did not answer, so the state cannot be told: ask again later."""

EXIT_CODES = {EXIT_OK: "ok", EXIT_FAILED: "failed", EXIT_UNKNOWN: "unknown", EXIT_PENDING: "pending",
              EXIT_UNAVAILABLE: "unavailable"}

STATUS_REDIS_TIMEOUT_MS = 5_000
"""Time budget of the one Redis read of ``status``, ms (a person waits; the stages' 100 ms would
make a loaded Redis look down)."""


@dataclass(frozen=True)
class Lookup:
    """What the stores say of a request id (exactly one of ``doc``, ``accepted``, ``unknown``,
    ``unavailable`` is set).

    Attributes:
        doc: The final result document.
        accepted: How it is known to be accepted (pending).
        unknown: True: no request has this id.
        job: For an unknown id, whether it is a job's id (``ocrstream job status``).
        unavailable: Why the state cannot be told (which store did not answer, and its error).
        progress: For a document's id, its pages' progress (pending or final).
    """

    doc: ResultDocument | None = None
    accepted: Accepted | None = None
    unknown: bool = False
    job: bool = False
    unavailable: str | None = None
    progress: Progress | None = None


async def look_up(s: CommonSettings, request_id: str) -> Lookup:
    """Read ``request_id``'s state: its final document (MariaDB), else whether it was accepted
    (:func:`services.common.requests.acceptance.accepted`: Redis, then MariaDB), else whether it is a job.

    Never raises for a store that does not answer: that is ``Lookup.unavailable``.
    """
    from services.common.requests.acceptance import accepted
    from services.common.cache.entries import CacheUnavailable, ResultCache
    from services.common.db import Database
    from services.common.documents.state import progress
    from services.common.jobs.store import JobStore
    from services.common.results.rows import ResultRows

    db = Database(s.mysql, pool_size=1)
    try:
        prog = await progress(db, request_id)
        doc = await ResultRows(db).get_request(request_id)
        if doc is not None:
            return Lookup(doc=doc, progress=prog)
        cache = ResultCache(s.redis.model_copy(update={"timeout_ms": max(s.redis.timeout_ms,
                                                                          STATUS_REDIS_TIMEOUT_MS)}))
        try:
            how = await accepted(db, cache, request_id)
        except CacheUnavailable as exc:
            return Lookup(unavailable=f"it has no final state, and Redis (OCRSTREAM_REDIS__URL), which holds the "
                                      f"HTTP door's accepted ids, did not answer: {exc or type(exc).__name__}",
                          progress=prog)
        finally:
            await cache.close()
        if how is not None:
            return Lookup(accepted=how, progress=prog)
        return Lookup(unknown=True, job=await JobStore(db).job(request_id) is not None)
    except (pymysql.MySQLError, OSError) as exc:
        return Lookup(unavailable=f"MariaDB (OCRSTREAM_MYSQL__HOST, OCRSTREAM_MYSQL__PORT) did not answer: {exc}")


def exit_code(look: Lookup) -> int:
    """The exit code of ``status`` for what was found (:data:`EXIT_CODES`)."""
    if look.doc is not None:
        return EXIT_OK if look.doc.status == "ok" else EXIT_FAILED
    if look.accepted is not None:
        return EXIT_PENDING
    return EXIT_UNKNOWN if look.unknown else EXIT_UNAVAILABLE


def not_final_line(request_id: str, look: Lookup) -> str:
    """The one stderr line of ``status`` for an id without a final document (plain text, no markup)."""
    rid = safe_text(request_id)
    if look.accepted is not None:
        acc = look.accepted
        if acc.by == "page":
            return (f"{rid}: pending: page {acc.page_number} of the document {safe_text(acc.document_id or '')}, "
                    f"not final yet (ocrstream status {safe_text(acc.document_id or '')})")
        return f"{rid}: pending: accepted, not final yet"
    if look.unknown:
        if look.job:
            return f"error: no request {request_id!r}: it is a job's id (ocrstream job status {rid})"
        return (f"error: no request {request_id!r}: none was accepted under this id (a request sent to ocr.submit is "
                "known once ingest has read it)")
    return f"error: the state of {request_id!r} cannot be told: {look.unavailable}"


def _task(doc: ResultDocument) -> str:
    """The task and its parameters: ``ocr``, ``extract (fields: date, total)``, ``translate (to: en)``."""
    p = doc.task_params
    if p is not None and p.fields:
        return f"{doc.task} (fields: {', '.join(p.fields)})"
    if p is not None and p.target_lang:
        return f"{doc.task} (to: {p.target_lang})"
    return doc.task


def timings_line(timings_ms: dict[str, float]) -> str:
    """``T ms in all: stage t, ...`` in pipeline order (:data:`services.cli.report.STAGES`, then
    any other key by name), ms rounded; ``-`` when there are none."""
    rest = sorted(k for k in timings_ms if k not in STAGES and k != "total")
    parts = [f"{k} {timings_ms[k]:.0f}" for k in (*STAGES, *rest) if k in timings_ms]
    total = timings_ms.get("total")
    head = "" if total is None else f"{total:.0f} ms in all"
    if not parts:
        return head or "-"
    return f"{head}: {', '.join(parts)}" if head else f"{', '.join(parts)} (ms)"


def summary_lines(doc: ResultDocument) -> list[str]:
    """What ``status`` prints of a final document before its result, one ``label:  value`` a line.

    ``request``, ``file`` (when known), ``status`` (with ``cache hit`` and its tier), ``error``
    (code and message), ``task`` (with its parameters), ``document`` (a page's) or ``pages`` (a
    document's, with those that failed), ``lines`` (not for an error; for a task other than
    ``ocr`` only when it has lines; with those left out of the stored row),
    ``timings``, then a ``note`` where the stored text is cut and each ``warning``. Every string
    from the document through :func:`services.cli.render.safe_text`.
    """
    out = [("request", doc.request_id)]
    if doc.filename:
        out.append(("file", doc.filename))
    hit = "" if not doc.cache_hit else f" (cache hit: {doc.cache_tier})" if doc.cache_tier else " (cache hit)"
    out.append(("status", doc.status + hit))
    if doc.error is not None:
        out.append(("error", f"{doc.error.code.value}: {doc.error.message}"))
    out.append(("task", _task(doc)))
    if doc.page_number is not None:
        of = f" of {doc.page_count}" if doc.page_count else ""
        out.append(("document", f"page {doc.page_number}{of} of {doc.document_id} "
                                f"(ocrstream status {doc.document_id})"))
    elif doc.page_count is not None:
        failed = (f"; {plural(len(doc.failed_pages), 'page', number=False)} "
                  f"{', '.join(map(str, doc.failed_pages))} failed") if doc.failed_pages else ""
        out.append(("pages", f"{doc.page_count}{failed}"))
    count = len(doc.lines) + doc.lines_omitted
    if doc.status != "error" and (doc.task == "ocr" or count):
        omitted = (f" ({doc.lines_omitted} not in the stored summary; all at {doc.result_uri})"
                   if doc.lines_omitted else "")
        out.append(("lines", f"{count}{omitted}"))
    out.append(("timings", timings_line(doc.timings_ms)))
    if doc.text_truncated:
        out.append(("note", "the text below is cut at the database row bound; the whole result is at "
                            f"{doc.result_uri}"))
    out.extend(("warning", w) for w in doc.warnings)
    return [f"{label + ':':<10}{safe_text(value).replace(chr(10), ' ')}" for label, value in out]
