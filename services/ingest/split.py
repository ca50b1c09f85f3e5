"""Ingest's split of a document (a PDF or multi-page TIFF) into one request per page (``docs/documents.md``)."""

from __future__ import annotations

import asyncio
import hashlib

from schemas.errors import ErrorCode
from schemas.events import RequestEvent
from schemas.ids import page_request_id
from schemas.keys import image_object_key
from services.common.decoding import DecoderPool
from services.common.errors import OcrError
from services.common.s3 import ObjectStore
from services.common.splitting import DOCUMENT_FORMATS


def is_document(req: RequestEvent) -> bool:
    """Whether an accepted request is a document to split: a PDF or TIFF of more than one page."""
    return req.format in DOCUMENT_FORMATS and req.frames > 1


async def split_pages(doc: RequestEvent, data: bytes, decoder: DecoderPool, store: ObjectStore,
                      batch_pages: int) -> list[RequestEvent]:
    """Render (PDF) or extract (TIFF) every page of ``doc``, store each under its own content hash
    and return the page requests, in page order.

    Pages are rendered ``batch_pages`` at a time in a decoder process and stored before the next
    ones are rendered, so at most ``batch_pages`` rendered pages are held. Each page is a PNG at
    ``images/<sha[:2]>/<sha>`` (stored unless there); its request is ``doc`` with its own
    ``request_id`` (:func:`~schemas.ids.page_request_id`), image fields, ``document_id``,
    ``page_number`` and ``page_count``, and no ``callback_url`` (the document's webhook fires for
    the document). Everything is a function of the document's bytes and id, so a replay of the
    split stores nothing new and announces the same requests.

    Raises:
        OcrError: a page that cannot be rendered (``corrupt_image``, ``image_too_large``,
            ``decode_timeout``, ``image_too_complex``): the document ends with it, no page announced.
    """
    n = doc.frames
    pages: list[RequestEvent] = []
    for first in range(0, n, batch_pages):
        rendered = await decoder.render_pages(data, first, min(batch_pages, n - first))
        shas = await asyncio.to_thread(lambda: [hashlib.sha256(png).hexdigest() for png, _, _ in rendered])
        await asyncio.gather(*(store.put_if_absent(image_object_key(sha), png, "image/png")
                               for sha, (png, _, _) in zip(shas, rendered)))
        for i, (sha, (png, w, h)) in enumerate(zip(shas, rendered)):
            number = first + i + 1
            pages.append(doc.model_copy(update={
                "request_id": page_request_id(doc.request_id, number), "content_sha256": sha,
                "image_uri": store.uri(image_object_key(sha)), "size_bytes": len(png), "format": "PNG",
                "width": w, "height": h, "frames": 1, "callback_url": None,
                "document_id": doc.request_id, "page_number": number, "page_count": n,
            }))
        del rendered
    if len(pages) != n:
        raise OcrError(ErrorCode.CORRUPT_IMAGE, f"the document renders to {len(pages)} pages, its header said {n}")
    return pages
