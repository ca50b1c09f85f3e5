"""The sink's assembly of a document once every page is final (``docs/documents.md``).

Called by the sink after a batch's final states are written: each page's final state is recorded
(:func:`services.common.documents.state.record_page`); for the page that completes its document, the
document result is assembled in page order from the pages' stored final states, written to S3 at
``documents/<document_id>.json`` (the first written is kept), and the document's own final state
(a bounded summary pointing there) goes through the same ``requests`` insert as every request, so
its completion is the first one MariaDB holds: byte-identical on a replay.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from schemas.errors import ErrorCode
from schemas.events import DocumentPage, DocumentResult, RequestEvent, ResultDocument
from schemas.keys import document_object_key
from schemas.reading import TASK_ANSWER_FIELDS, TASK_TEXT_ANSWERS, ErrorInfo, Line, Page
from services.common.documents import state as documents
from services.common.db import Database
from services.common.results.rows import ResultRows
from services.common.codec import dumps
from services.common.cache.outputs import OutputLru
from services.common.s3 import ObjectStore

_JOINED_SLOTS = TASK_TEXT_ANSWERS
"""The task slots a document's own answer holds, its pages' in page order separated by a blank
line, as its ``text`` (``fields``, one object a page, is left to the pages)."""


def document_status(page_count: int, failed: int, max_page_error_rate: float) -> str:
    """A document's status from its failed pages: ``ok`` (none failed); ``error`` when every page
    failed, or when ``max_page_error_rate`` > 0 and ``failed / page_count`` is above it;
    ``partial`` otherwise (with the default rate 0 any failed page, short of all, makes it partial).

    Args:
        page_count: Pages of the document (>= 1).
        failed: Pages that ended in error.
        max_page_error_rate: ``OCRSTREAM_MAX_PAGE_ERROR_RATE`` in [0, 1]; 0: no rate makes it an error.
    """
    if failed == 0:
        return "ok"
    if failed >= page_count or (max_page_error_rate > 0 and failed / page_count > max_page_error_rate):
        return "error"
    return "partial"


def _page_of(number: int, final: ResultDocument, lines: list[Line]) -> DocumentPage:
    return DocumentPage(
        page_number=number, request_id=final.request_id, status="error" if final.status == "error" else "ok",
        error=final.error, content_sha256=final.content_sha256, result_uri=final.result_uri,
        cache_hit=final.cache_hit, width=final.width, height=final.height,
        lines=[ln.model_copy(update={"page": number}) for ln in lines], text=final.text,
        warnings=final.warnings, **{k: getattr(final, k) for k in TASK_ANSWER_FIELDS})


def assemble(doc: RequestEvent, page_count: int, pages: list[DocumentPage], finals: list[ResultDocument],
             max_page_error_rate: float) -> DocumentResult:
    """The document result from its pages (in page order) and their final states. Pure: the same
    pages give the same result (its times are the pages' own)."""
    failed = [p.page_number for p in pages if p.status == "error"]
    status = document_status(page_count, len(failed), max_page_error_rate)
    error = None
    if status == "error":
        shown = ", ".join(f"{p.page_number} ({p.error.code.value if p.error else 'error'})"
                          for p in pages if p.status == "error")
        error = ErrorInfo(code=ErrorCode.DOCUMENT_PAGES_FAILED,
                          message=f"{len(failed)} of {page_count} pages failed: {shown}"[:1000])
    done = [f.completed_at_ms for f in finals if f.completed_at_ms is not None]
    return DocumentResult(
        document_id=doc.request_id, status=status, error=error, content_sha256=doc.content_sha256,
        filename=doc.filename, task=doc.task, task_params=doc.task_params, page_count=page_count,
        pages_ok=page_count - len(failed), failed_pages=failed,
        text="\n\n".join(p.text for p in pages if p.text), pages=pages,
        submitted_at_ms=doc.submitted_at_ms, completed_at_ms=max(done) if done else None)


def _joined_slots(pages: list[DocumentPage]) -> dict[str, str | None]:
    """:data:`_JOINED_SLOTS` of the document: each one's pages' values (those that have one) in
    page order, separated by a blank line; None where no page has one."""
    joined: dict[str, str | None] = {}
    for k in _JOINED_SLOTS:
        parts = [getattr(p, k) for p in pages if getattr(p, k)]
        joined[k] = "\n\n".join(parts) if parts else None
    return joined


def summary(doc: RequestEvent, result: DocumentResult, finals: list[ResultDocument], result_uri: str,
            trace_id: str | None) -> ResultDocument:
    """The document's own final state: its status, pages, lines (page numbers set), text, the
    task's ``markdown``/``html``/``latex``/``translation`` (:func:`_joined_slots`) and the
    pointer to the whole; MariaDB bounds it like any request's (``lines_omitted``, ``text_truncated``)."""
    first_ok = next((f for f in finals if f.status == "ok"), None)
    pages = [Page(index=p.page_number, width=p.width or 1, height=p.height or 1,
                  alpha_background=(f.pages[0].alpha_background if f.pages else None))
             for p, f in zip(result.pages, finals)]
    total = float(max(0, (result.completed_at_ms or 0) - (doc.submitted_at_ms or 0)))
    return ResultDocument(
        request_id=doc.request_id, status=result.status, error=result.error, content_sha256=doc.content_sha256,
        engine=first_ok.engine if first_ok else None, model=first_ok.model if first_ok else None,
        model_revision=first_ok.model_revision if first_ok else None,
        width=pages[0].width if pages else doc.width, height=pages[0].height if pages else doc.height,
        pages=pages, lines=[ln for p in result.pages for ln in p.lines], text=result.text,
        warnings=sorted({w for p in result.pages for w in p.warnings}), task=doc.task, task_params=doc.task_params,
        source=doc.source, filename=doc.filename, result_uri=result_uri, submitted_at_ms=doc.submitted_at_ms,
        completed_at_ms=result.completed_at_ms, timings_ms={**doc.timings_ms, "total": total}, trace_id=trace_id,
        callback_url=doc.callback_url, api_key_id=doc.api_key_id, metadata=doc.metadata,
        document_id=doc.request_id, page_count=result.page_count, failed_pages=result.failed_pages, job_id=doc.job_id,
        **_joined_slots(result.pages))


def _trace_id(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<32 hex>-<16 hex>-<2 hex>``), or None."""
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


class DocumentAssembler:
    """Records pages and assembles the documents they complete (module docstring).

    Args:
        db: MariaDB (``documents``, ``document_pages``, ``requests``).
        store: S3 (page outputs read, the document result written).
        outputs: The sink's LRU of stored outputs (a page over the row bound is read whole from it).
        max_page_error_rate: ``OCRSTREAM_MAX_PAGE_ERROR_RATE``.
        on_assembled: Awaited with ``(document request, pages' final states, document's final
            state)`` after each assembly, before it is returned (the sink caches an ok document
            under its file's key: :mod:`services.sink.document_cache`).
    """

    def __init__(self, db: Database, store: ObjectStore, outputs: OutputLru, max_page_error_rate: float,
                 on_assembled: Callable[[RequestEvent, list[ResultDocument], ResultDocument],
                                        Awaitable[object]] | None = None):
        self.db = db
        self.rows = ResultRows(db)
        self.store = store
        self.outputs = outputs
        self.rate = max_page_error_rate
        self.on_assembled = on_assembled

    async def completed_documents(self, finals: list[ResultDocument]) -> list[str]:
        """Record every page among ``finals`` (final states as MariaDB holds them); the ids of the
        documents one of them completes (each at most once).

        Raises:
            pymysql.OperationalError: MariaDB unreachable (the runner retries the batch).
        """
        done: list[str] = []
        for f in finals:
            if f.document_id is None or f.page_number is None:
                continue
            if await documents.record_page(self.db, f) and f.document_id not in done:
                done.append(f.document_id)
        return done

    async def assemble(self, document_id: str) -> ResultDocument | None:
        """Assemble ``document_id`` (every page final), store it and return its summary (not yet
        inserted: the caller writes it with the batch's final states). None if it is unknown.

        Raises:
            OcrError: a page's stored output is gone (``missing_object``).
        """
        row = await documents.document_row(self.db, document_id)
        if row is None:
            return None
        doc, page_count = row
        numbered = await documents.page_requests(self.db, document_id)
        held = await self.rows.get_requests([rid for _, rid in numbered])
        present = [(number, held[rid]) for number, rid in numbered if rid in held]  # all: rows follow requests'
        finals = [final for _, final in present]
        pages = []
        for number, final in present:
            lines = final.lines
            if (final.lines_omitted or final.text_truncated) and final.result_uri:  # over the row bound
                whole = await self.outputs.load(final.result_uri)
                lines, final = whole.lines, final.model_copy(update={  # the row may have left its slots out too
                    "text": whole.text, **{k: getattr(whole, k) for k in TASK_ANSWER_FIELDS if getattr(final, k) is None}})
            pages.append(_page_of(number, final, lines))
        result = assemble(doc, page_count, pages, finals, self.rate)
        key = document_object_key(document_id)
        await self.store.put_if_absent(key, dumps(result), "application/json")  # the first written is kept
        uri = self.store.uri(key)
        await documents.mark_assembled(self.db, document_id, result.status, uri)
        final = summary(doc, result, finals, uri, _trace_id(doc.traceparent))
        if self.on_assembled is not None:
            await self.on_assembled(doc, finals, final)
        return final
