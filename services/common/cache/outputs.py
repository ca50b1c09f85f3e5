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
        max_bytes: Bound on the JSON size of the documents kept, bytes (0 = entries only). A
            parsed document takes about 8x its JSON in memory (measured: 441 B of JSON, one
            text line, ~3.3 KB; 4.3 KB, 30 lines, ~35 KB).
    """

    def __init__(self, store: ObjectStore, entries: int, max_bytes: int = 0):
        self.store = store
        self.entries = entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._docs: OrderedDict[str, tuple[OcrOutput, int]] = OrderedDict()

    async def load(self, uri: str) -> OcrOutput:
        """The document at ``uri``, from memory or S3.

        Raises:
            OcrError: ``missing_object`` when it is not in S3; S3 errors from the store.
            pydantic.ValidationError: the object is not an ``OcrOutput``.
        """
        kept = self._docs.get(uri)
        if kept is not None:
            self._docs.move_to_end(uri)
            return kept[0]
        bucket, key = parse_s3_uri(uri)
        raw = await self.store.get(key, bucket=bucket)
        doc = OcrOutput.model_validate_json(raw)
        self.remember(uri, doc, len(raw))
        return doc

    def remember(self, uri: str, output: OcrOutput, size: int) -> None:
        """Keep ``output`` as the document at ``uri`` (just written, so the next read is free).

        Args:
            size: Its JSON size in bytes (what ``max_bytes`` counts).
        """
        if self.entries <= 0 or (self.max_bytes and size > self.max_bytes):
            return
        old = self._docs.pop(uri, None)
        if old is not None:
            self.bytes -= old[1]
        self._docs[uri] = (output, size)
        self.bytes += size
        while len(self._docs) > self.entries or (self.max_bytes and self.bytes > self.max_bytes):
            _, (_, dropped) = self._docs.popitem(last=False)
            self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._docs)
