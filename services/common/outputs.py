"""OCR output documents read from S3 by URI, kept in a bounded in-process LRU."""

from __future__ import annotations

from collections import OrderedDict

from schemas.events import OcrOutput
from services.common.s3 import ObjectStore, parse_s3_uri


class OutputLru:
    """``OcrOutput`` documents by result URI (``s3://bucket/results/<sha>/<gen>.json``).

    A document at one URI is the output for one cache key and never changes meaning, so a kept
    copy stays valid; a purge changes the generation and therefore the URI.

    Args:
        store: Where the documents are read from.
        entries: Documents kept (least recently used dropped first); 0 keeps none.
    """

    def __init__(self, store: ObjectStore, entries: int):
        self.store = store
        self.entries = entries
        self._docs: OrderedDict[str, OcrOutput] = OrderedDict()

    async def load(self, uri: str) -> OcrOutput:
        """The document at ``uri``, from memory or S3.

        Raises:
            OcrError: ``missing_object`` when it is not in S3; S3 errors from the store.
            pydantic.ValidationError: the object is not an ``OcrOutput``.
        """
        doc = self._docs.get(uri)
        if doc is not None:
            self._docs.move_to_end(uri)
            return doc
        bucket, key = parse_s3_uri(uri)
        doc = OcrOutput.model_validate_json(await self.store.get(key, bucket=bucket))
        self.remember(uri, doc)
        return doc

    def remember(self, uri: str, output: OcrOutput) -> None:
        """Keep ``output`` as the document at ``uri`` (just written, so the next read is free)."""
        if self.entries <= 0:
            return
        self._docs[uri] = output
        self._docs.move_to_end(uri)
        while len(self._docs) > self.entries:
            self._docs.popitem(last=False)
