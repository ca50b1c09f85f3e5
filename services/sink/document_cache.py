"""An assembled document cached under its file's key, so the same file sent again to the HTTP door is answered at once.

The HTTP door looks a file up by its cache key (``<gen>[:<scope>]:<sha256 of the file>``) before
it checks or stores it (``services/api/serving_submit.py``); an image's key gets its entry when the
sink stores its computed output. A document is never computed under the file's key (its pages
are, each under its own), so the sink gives it one when it assembles it: the document's whole
output (:func:`~services.common.results.build.document_output` of its final state: every page's lines,
the pages' texts and the task's Markdown/HTML/LaTeX/translation, the page sizes) at
``results/...`` under the file's key, its ``results`` row, and its Redis entry, exactly as for an image's computed output. Then a repeat of the file is a
plain cache hit at the door (200, ``cache_hit`` true) and, where a Kafka submission is not split
(``OCRSTREAM_SPLIT_DOCUMENTS=false``), at dedup.

Only a document that is ``ok`` (no failed page) and whose every page's output is stored under
that page's key of this deployment's generation, in the document's cache scope, is cached: its
content is then what this deployment computes for the file. A ``partial`` or ``error`` document
is not (sending it again splits it again; its computed pages are cache hits).
"""

from __future__ import annotations

import logging

from schemas.events import RequestEvent, ResultDocument
from schemas.keys import result_object_key
from services.common.cache.entries import CacheEntry, CacheUnavailable, ResultCache
from services.common.db import Database
from services.common.results.rows import ResultRows
from services.common.codec import dumps
from services.common.results.build import document_output
from services.common.s3 import ObjectStore
from services.sink.settings import SinkSettings

log = logging.getLogger(__name__)


def document_cache_key(s: SinkSettings, store: ObjectStore, doc: RequestEvent,
                       finals: list[ResultDocument], summary: ResultDocument) -> str | None:
    """The file's cache key when the assembled document may be cached under it (module docstring), else None.

    Args:
        doc: The document's request (its file's ``content_sha256``, task, parameters, API key).
        finals: Every page's final state, in page order.
        summary: The document's own final state.
    """
    if summary.status != "ok" or summary.failed_pages or not doc.content_sha256 or not finals:
        return None
    gen = s.generation(doc.task, doc.task_params)
    for f in finals:
        if f.status != "ok" or not f.content_sha256 or f.cache_key is None:
            return None
        if (f.cache_key != s.cache_key_of(f.content_sha256, gen, doc.api_key_id)
                or f.result_uri != store.uri(result_object_key(f.cache_key))):
            return None  # another generation or scope, or stored under its request (not cacheable)
    return s.cache_key_of(doc.content_sha256, gen, doc.api_key_id)


async def cache_document(s: SinkSettings, store: ObjectStore, db: Database, cache: ResultCache, doc: RequestEvent,
                         finals: list[ResultDocument], summary: ResultDocument) -> str | None:
    """Store the assembled document's output under its file's key when it may be cached
    (:func:`document_cache_key`): the S3 object (the first written kept: a replay writes nothing
    new), its ``results`` row (an upsert) and its Redis entry (skipped, logged, when Redis does not answer).

    Returns:
        The key it was cached under, or None.

    Raises:
        pymysql.OperationalError: MariaDB unreachable; S3 errors from the store (the runner retries the batch).
    """
    key = document_cache_key(s, store, doc, finals, summary)
    if key is None:
        return None
    output = document_output(summary.model_copy(update={"cache_key": key}))
    output = output.model_copy(update={"created_at_ms": summary.completed_at_ms or output.created_at_ms})
    okey = result_object_key(key)
    await store.put_if_absent(okey, dumps(output), "application/json")
    uri = store.uri(okey)
    await ResultRows(db).write_result(cache_key=key, content_sha256=doc.content_sha256, engine=output.engine, model=output.model,
                          model_revision=output.model_revision, task=doc.task, result_uri=uri,
                          line_count=len(output.lines), text=output.text, created_at_ms=output.created_at_ms)
    try:
        await cache.put(key, CacheEntry(uri, len(output.lines), len(output.text), output.created_at_ms),
                        s.ttl_for(doc.source, doc.task))
    except CacheUnavailable as exc:
        log.info("sink: Redis unavailable (%s); no cache entry for document %s", exc, doc.request_id)
    return key
