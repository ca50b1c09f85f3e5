"""A PDF opened with every page its page tree holds, whatever the tree's ``/Count`` says.

PDFium (pypdfium2) takes the page count from the page tree root's ``/Count`` as it stands (its
``CPDF_Document::RetrievePageCount``): a file whose ``/Count`` says 1 over three pages opens as
one page, pages 2 and 3 out of reach; one that says 5 over three fails at page 4. qpdf (pikepdf)
counts by walking ``/Kids`` leaf by leaf (``QPDF::getAllPages``, loops detected) and writes the
file back with every ``/Count`` set from that walk. Where the two counts disagree, the document is
read from qpdf's rewrite, so no page is dropped (``docs/documents.md``).

Like :mod:`services.common.images.imaging`, these run in the decoder processes (memory cap and timeout:
:mod:`services.common.images.decoding`); qpdf reads only the page tree, not the pages' content.
"""

from __future__ import annotations

import io
import logging
from typing import BinaryIO

from schemas.errors import ErrorCode
from services.common.errors import OcrError

log = logging.getLogger(__name__)


def _pdfium(data: bytes | BinaryIO):
    import pypdfium2 as pdfium  # imported lazily: only PDFs need it

    try:
        return pdfium.PdfDocument(data)
    except MemoryError:
        raise
    except Exception as exc:  # pdfium raises PdfiumError for damaged files
        if getattr(exc, "err_code", None) == 0:  # refused with "PDFium: Success": no page tree, or an empty one
            raise OcrError(ErrorCode.CORRUPT_IMAGE, "the PDF has no pages (no page tree with a page in it)") from exc
        raise OcrError(ErrorCode.CORRUPT_IMAGE, f"PDF could not be opened: {exc}") from exc


def _rewind(data: bytes | BinaryIO) -> bytes | BinaryIO:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        data.seek(0)
    return data


def _qpdf_open(data: bytes | BinaryIO):
    import pikepdf  # imported lazily: only PDFs need it

    src = _rewind(data)
    return pikepdf.open(io.BytesIO(bytes(src)) if isinstance(src, (bytes, bytearray, memoryview)) else src)


def tree_page_count(data: bytes | BinaryIO) -> int | None:
    """Pages in the PDF's page tree, counted leaf by leaf by qpdf (``/Count`` ignored); None when
    qpdf cannot read the file (pdfium, which repairs other damage, then decides alone).

    Raises:
        MemoryError: under the decoder's memory cap (a page tree of millions of entries).
    """
    try:
        with _qpdf_open(data) as pdf:
            return len(pdf.pages)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - qpdf refuses what it cannot read; pdfium has the last word
        log.debug("qpdf cannot read the page tree: %s", exc)
        return None


def _rewritten(data: bytes | BinaryIO) -> bytes:
    """The PDF as qpdf writes it back: the same objects, every ``/Count`` from the walked tree."""
    out = io.BytesIO()
    with _qpdf_open(data) as pdf:
        pdf.save(out, fix_metadata_version=False)
    return out.getvalue()


def open_pdf(data: bytes | BinaryIO, *, pages_needed: int = 0, walk_tree: bool = False):
    """A ``pypdfium2.PdfDocument`` of ``data`` that reaches every page of its page tree.

    PDFium opens ``data`` as it is; it is opened again from qpdf's rewrite (:func:`_rewritten`)
    when it holds fewer than ``pages_needed`` pages, or, with ``walk_tree``, when qpdf's count of
    the tree (:func:`tree_page_count`) differs from PDFium's. ``walk_tree`` costs one walk of the
    tree (about 40 ms for 2,000 pages, under 1 ms for ten): the page count is read with it once
    per document; a render asks only for the pages it needs.

    Raises:
        OcrError: ``corrupt_image`` when PDFium cannot open the file (or qpdf's rewrite of it).
    """
    doc = _pdfium(_rewind(data))
    n = len(doc)
    tree = tree_page_count(data) if walk_tree else None
    if pages_needed <= n and tree in (None, n):
        return doc
    if tree is None:
        tree = tree_page_count(data)
        if tree is None or tree <= n:
            return doc  # nothing more to reach: the caller finds the pages missing
    doc.close()
    log.warning("the PDF's page tree holds %d pages, its /Count says %d: read from qpdf's rewrite", tree, n)
    try:
        fixed = _rewritten(data)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - qpdf counted the tree but cannot write it back
        raise OcrError(ErrorCode.CORRUPT_IMAGE,
                       f"the PDF's page tree holds {tree} pages, its /Count says {n}, and it cannot be "
                       f"rewritten: {exc}") from exc
    return _pdfium(fixed)
