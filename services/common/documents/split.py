"""Ingest's split of a document (a PDF or multi-page TIFF) into one request per page (``docs/documents.md``)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import NamedTuple

from schemas.errors import ErrorCode
from schemas.events import RequestEvent
from schemas.ids import page_request_id
from schemas.keys import image_object_key
from services.common.images.decoding import DecoderPool, DecoderStopped
from services.common.errors import OcrError
from services.common.s3 import ObjectStore
from services.common.documents.splitting import DOCUMENT_FORMATS


def is_document(req: RequestEvent) -> bool:
    """Whether an accepted request is a document to split: a PDF or TIFF of more than one page."""
    return req.format in DOCUMENT_FORMATS and req.frames > 1


class SplitPage(NamedTuple):
    """One page of a split document: its request, and its error when it could not be rendered
    (then it has no image: ``content_sha256`` and ``image_uri`` are None)."""

    request: RequestEvent
    error: OcrError | None = None


async def split_pages(doc: RequestEvent, data: bytes, decoder: DecoderPool, store: ObjectStore,
                      batch_pages: int) -> list[SplitPage]:
    """Render (PDF) or extract (TIFF) every page of ``doc``, store each under its own content hash
    and return the page requests, in page order.

    Pages are rendered ``batch_pages`` at a time in a decoder process and stored before the next
    ones are rendered, so at most ``batch_pages`` rendered pages are held. Each page is a PNG at
    ``images/<sha[:2]>/<sha>`` (stored unless there); its request is ``doc`` with its own
    ``request_id`` (:func:`~schemas.ids.page_request_id`), image fields, ``document_id``,
    ``page_number`` and ``page_count``, and no ``callback_url`` (the document's webhook fires for
    the document). A page that alone cannot be rendered (``corrupt_image``, ``image_too_large``,
    ``image_too_complex``, ``decode_timeout``: :meth:`~services.common.images.decoding.DecoderPool.render_pages`)
    comes with its error and no image; the other pages are rendered as ever. Everything is a
    function of the document's bytes and id, so a replay of the split stores nothing new and
    announces the same requests.

    Raises:
        OcrError: the document as a whole cannot be rendered (it does not open, fewer pages than its
            header said, the decoder stopped on two pages in a row): the document ends with it, no
            page announced.
    """
    n = doc.frames
    pages: list[SplitPage] = []
    stopped = False  # the last page stopped the decoder: one more in a row ends the document
    for first in range(0, n, batch_pages):
        rendered = await decoder.render_pages(data, first, min(batch_pages, n - first), after_stop=stopped)
        stopped = bool(rendered) and isinstance(rendered[-1], DecoderStopped)
        pngs = [r for r in rendered if not isinstance(r, OcrError)]
        shas = iter(await asyncio.to_thread(lambda: [hashlib.sha256(png).hexdigest() for png, _, _ in pngs]))
        keys = [(next(shas), r) if not isinstance(r, OcrError) else (None, r) for r in rendered]
        await asyncio.gather(*(store.put_if_absent(image_object_key(sha), r[0], "image/png")
                               for sha, r in keys if sha is not None))
        for i, (sha, r) in enumerate(keys):
            number = first + i + 1
            page = doc.model_copy(update={
                "request_id": page_request_id(doc.request_id, number), "callback_url": None, "frames": 1,
                "document_id": doc.request_id, "page_number": number, "page_count": n, "priority": "bulk"})
            if sha is None:  # this page alone could not be rendered
                pages.append(SplitPage(page.model_copy(update={
                    "content_sha256": None, "image_uri": None, "size_bytes": 0, "format": None,
                    "width": None, "height": None}), r))
                continue
            png, w, h = r
            pages.append(SplitPage(page.model_copy(update={
                "content_sha256": sha, "image_uri": store.uri(image_object_key(sha)), "size_bytes": len(png),
                "format": "PNG", "width": w, "height": h})))
        del rendered, pngs, keys
    if len(pages) != n:
        raise OcrError(ErrorCode.CORRUPT_IMAGE, f"the document renders to {len(pages)} pages, its header said {n}")
    return pages
