"""Result events, stored outputs and result documents, each built in one place.

- :func:`cache_hit_event`: the ``ocr.result.v1`` event of a request answered from a cache tier
  (dedup's tiers, and the HTTP door's Redis answer).
- :func:`result_document`: a request's final document (``ocr.result_document.v1``) from its
  request, its result event and its stored output: what the sink writes to MariaDB and emits on
  ``ocr.completed``, and what the HTTP door answers a cached image with (200), so both say the
  same thing.
- :func:`ocr_output` and :func:`document_output`: the stored output (``ocr.output.v1``) of a
  computed result, and of a finished document (the sink's copy of a document over the row bound).

Pure: no clock, no I/O, no telemetry. The caller passes the completion time, the trace id and
its own timings; spans and logs stay with the stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import orjson

from schemas.events import CacheTier, OcrOutput, RequestEvent, ResultDocument, ResultEvent
from schemas.keys import CacheGeneration
from schemas.reading import TASK_ANSWER_FIELDS, Line, Page
from schemas.tasks import TASKS

#: The task answer a result carries besides its lines (:class:`schemas.reading.TaskAnswer`: each
#: task fills one field, its slot in ``schemas.tasks.TASKS``), and ``raw_output``: copied as they
#: are from the result event into the stored output and from the output into the document.
TASK_OUTPUTS = (*TASK_ANSWER_FIELDS, "raw_output")


def full_text(lines: Iterable[Line]) -> str:
    """The lines' texts joined by newlines, pages separated by a blank line (``ResultDocument.text``)."""
    parts: list[str] = []
    page = None
    for line in lines:
        if page is not None and line.page != page:
            parts.append("")
        parts.append(line.text)
        page = line.page
    return "\n".join(parts)


def task_text(task: str, lines: Iterable[Line], outputs: Mapping[str, object]) -> str:
    """``text`` of a result of ``task``: for ``ocr`` (slot ``lines``) the lines by
    :func:`full_text`; for another task its slot's text (``markdown``, ``html``, ``latex``,
    ``translation``) or, for ``extract``, its ``fields`` as one JSON object (UTF-8, in the order
    asked), so a reader of ``text`` alone still sees the answer; the lines' text when the slot is
    empty (an unknown task included)."""
    spec = TASKS.get(task)
    value = outputs.get(spec.slot) if spec is not None and spec.slot != "lines" else None
    if isinstance(value, dict):
        return orjson.dumps(value).decode()
    if isinstance(value, str):
        return value
    return full_text(lines)


def _outputs_of(x: ResultEvent | OcrOutput | ResultDocument) -> dict[str, object]:
    """The task output fields of ``x`` (:data:`TASK_OUTPUTS`)."""
    return {k: getattr(x, k) for k in TASK_OUTPUTS}


def cache_hit_event(request: RequestEvent, cache_key: str, tier: CacheTier, gen: CacheGeneration, *,
                    result_uri: str | None = None, engine: str | None = None, model: str | None = None,
                    model_revision: str | None = None, cacheable: bool = True,
                    near_duplicate_of: str | None = None, pages: Sequence[Page] = (),
                    lines: Sequence[Line] = (), warnings: Sequence[str] = ()) -> ResultEvent:
    """The result event (status ``ok``, ``cache_hit`` true) of ``request`` answered from ``tier``.

    Two kinds:

    - an exact hit (every tier but ``near``): ``result_uri`` is the stored output
      (``s3://.../results/<sha>/<gen>.json``), which the sink reads; no lines ride on the event;
    - a near-duplicate hit (tier ``near``): ``near_duplicate_of`` is the look-alike's content
      SHA-256 and ``pages``/``lines``/``warnings`` its result, boxes already rescaled to this
      image; no ``result_uri`` (the sink stores the output under ``cache_key``).

    Args:
        request: The request answered.
        cache_key: Its cache key (``<gen_id>:<sha256>``, scoped as the caller's).
        tier: Where it was answered from (:data:`schemas.events.CACHE_TIERS`).
        gen: The request's cache generation: the engine, model and revision of the result
            unless ``engine``/``model``/``model_revision`` name who computed it (a settlement's).
        cacheable: False when the stored result is another generation's (a key whose holder an
            infer of another generation computed): the sink then stores nothing under the key.

    Raises:
        ValueError: an exact hit without ``result_uri`` or with ``near_duplicate_of``, or a
            ``near`` hit without ``near_duplicate_of`` or with ``result_uri``.
    """
    near = tier == "near"
    if near != (near_duplicate_of is not None) or near == (result_uri is not None):
        raise ValueError(f"a {tier!r} hit takes {'near_duplicate_of' if near else 'result_uri'} "
                         f"and not {'result_uri' if near else 'near_duplicate_of'}")
    return ResultEvent(
        request=request, cache_key=cache_key, cache_hit=True, cache_tier=tier, status="ok", result_uri=result_uri,
        engine=engine or gen.engine, model=model or gen.model, model_revision=model_revision or gen.model_revision,
        cacheable=cacheable, near_duplicate_of=near_duplicate_of, pages=list(pages), lines=list(lines),
        warnings=list(warnings),
    )


def ocr_output(ev: ResultEvent) -> OcrOutput:
    """The output to store (``ocr.output.v1``) of a computed result (ok, with its key), or of a
    near-duplicate hit: its pages, lines, warnings, the request's task and ``task_params``, the
    task's output fields (:data:`TASK_OUTPUTS`), ``text`` by :func:`task_text`.
    ``created_at_ms`` is now (the model's default)."""
    req = ev.request
    outputs = _outputs_of(ev)
    return OcrOutput(
        cache_key=ev.cache_key, content_sha256=req.content_sha256, engine=ev.engine or "", model=ev.model or "",
        model_revision=ev.model_revision or "", task=req.task, task_params=req.task_params, pages=ev.pages,
        lines=ev.lines, text=task_text(req.task, ev.lines, outputs), near_duplicate_of=ev.near_duplicate_of,
        warnings=ev.warnings, **outputs,
    )


def document_output(doc: ResultDocument) -> OcrOutput:
    """The whole OCR output of a finished ok document, as stored for one over the database row
    bound (its row then leaves the lines out and points here); missing identity fields are ``""``."""
    return OcrOutput(
        cache_key=doc.cache_key or "", content_sha256=doc.content_sha256 or "", engine=doc.engine or "",
        model=doc.model or "", model_revision=doc.model_revision or "", task=doc.task, task_params=doc.task_params,
        pages=doc.pages, lines=doc.lines, text=doc.text, near_duplicate_of=doc.near_duplicate_of,
        warnings=doc.warnings, **_outputs_of(doc))


def answer_fields(req: RequestEvent, stored: Mapping[str, str | None] | None) -> dict[str, str | None] | None:
    """The ``fields`` of ``req``'s answer from a stored extraction's ``stored`` fields: exactly
    the fields ``req`` asks for, in its order, each with its stored value (None where the stored
    answer lacks it); None when nothing changes (not an ``extract`` request, no stored fields, or
    the same fields in the same order), so the stored ``text`` stands. A stored extraction may
    hold more fields (a hit of tier ``fields``) or the same in another order (the same key)."""
    asked = req.task_params.fields if req.task_params is not None else None
    if req.task != "extract" or not asked or stored is None or list(stored) == list(asked):
        return None
    return {f: stored.get(f) for f in asked}


def result_document(req: RequestEvent, ev: ResultEvent, output: OcrOutput | None, *, cache_hit: bool,
                    stored_uri: str | None, completed_at_ms: int, trace_id: str | None,
                    timings_ms: Mapping[str, float] | None = None, total_ms: float | None = None) -> ResultDocument:
    """The final document of ``req`` from its result ``ev`` and the stored ``output``.

    The rules, the same at the sink and at the HTTP door:

    - ``status`` and ``engine``/``model``/``model_revision`` are the event's; ``error`` only on
      an error result;
    - the content (``pages``, ``lines``, ``text``, ``warnings``, ``near_duplicate_of``, the
      task's output fields ``markdown``/``html``/``latex``/``fields``/``translation``) is the
      output's, except that an ``extract`` request's ``fields`` (and ``text``) are the fields it
      asks for, in its order (:func:`answer_fields`: the output may hold more, or another
      order); without an output (an error, or a result whose output was not stored) the
      event's pages, warnings and ``raw_output`` (an ``unparsable_output`` error keeps the
      model's answer for inspection) and no lines;
    - ``width``/``height`` are page 1's, else the request's (an error before decoding: None);
    - ``cache_tier`` is the event's only when ``cache_hit``;
    - ``result_uri`` is ``stored_uri`` only when there is an output stored under the event's
      key (an output, a ``cache_key``, ``cacheable``), else None;
    - ``timings_ms``: the request's timings, then ``timings_ms``, then ``total``:
      ``total_ms``, or by default ``completed_at_ms - req.submitted_at_ms`` (never negative);
    - the request's identity and the submitter's fields (``task``, ``source``, ``filename``,
      ``callback_url``, ``api_key_id``, ``metadata``, ``submitted_at_ms``, ``task_params``, ``job_id``, and a
      page's ``document_id``/``page_number``/``page_count``) are ``req``'s.

    Args:
        req: The request completed: ``ev.request``, or a waiter answered with its holder's ``ev``.
        ev: Its result event (ok or error).
        output: The stored output of the result, or None.
        cache_hit: Whether the request was answered from a cache tier.
        stored_uri: Where the output is stored under ``ev.cache_key`` (``s3://``).
        completed_at_ms: Completion time, epoch ms.
        trace_id: The request's trace id (32 hex digits), or None.
        timings_ms: The completing stage's own entries, ms (the sink's ``queue_sink`` and ``write``).
        total_ms: ``total`` when the caller measured it itself (the door's cache answer), ms.
    """
    pages = output.pages if output is not None else ev.pages
    first = pages[0] if pages else None
    timings = {**req.timings_ms, **(timings_ms or {})}
    timings["total"] = total_ms if total_ms is not None else float(max(0, completed_at_ms - req.submitted_at_ms))
    outputs = _outputs_of(output) if output is not None else {"raw_output": ev.raw_output}
    text = output.text if output is not None else ""
    if output is not None and (asked := answer_fields(req, output.fields)) is not None:
        outputs["fields"], text = asked, task_text(req.task, output.lines, {"fields": asked})
    return ResultDocument(
        request_id=req.request_id,
        status=ev.status,
        error=ev.error if ev.status == "error" else None,
        content_sha256=req.content_sha256,
        cache_key=ev.cache_key,
        cache_hit=cache_hit,
        cache_tier=ev.cache_tier if cache_hit else None,
        near_duplicate_of=output.near_duplicate_of if output is not None else None,
        engine=ev.engine,
        model=ev.model,
        model_revision=ev.model_revision,
        width=first.width if first else req.width,
        height=first.height if first else req.height,
        pages=pages,
        lines=output.lines if output is not None else [],
        text=text,
        warnings=output.warnings if output is not None else ev.warnings,
        task=req.task,
        task_params=req.task_params,
        source=req.source,
        filename=req.filename,
        result_uri=stored_uri if output is not None and ev.cache_key and ev.cacheable else None,
        submitted_at_ms=req.submitted_at_ms,
        completed_at_ms=completed_at_ms,
        timings_ms=timings,
        trace_id=trace_id,
        callback_url=req.callback_url,
        api_key_id=req.api_key_id,
        metadata=req.metadata,
        job_id=req.job_id,
        document_id=req.document_id,
        page_number=req.page_number,
        page_count=req.page_count,
        **outputs,
    )
