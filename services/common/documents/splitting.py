"""Documents split into pages: the page count and pixel checks before any render, then one page at a time.

A *document* is a PDF or a multi-page TIFF (``docs/documents.md``). Ingest splits it into one
request per page. These functions do the pixel work; like :mod:`services.common.images.imaging` they run
in-process and unbounded, so the stages call them only through the decoder processes
(:class:`services.common.images.decoding.DecoderPool`, ops ``doc_plan`` and ``render``).

* :func:`document_plan`: the format, and for a document its page count (a PDF's from the page
  tree, a TIFF's by walking frame headers up to ``max_document_pages + 1``) and every page's size,
  checked against the document limits (``document_too_many_pages``, ``document_too_large``):
  nothing is rendered or decoded. A page over ``max_pixels`` fails alone at its render. Any other
  image gets the checks of :func:`~services.common.images.imaging.page_sizes` as before.
* :func:`render_pages`: pages ``first .. first+count-1`` as PNG bytes, one at a time (a PDF page
  rendered at :data:`~services.common.images.imaging.PDF_RENDER_DPI` onto white, as the one-request path
  renders it; a TIFF frame in its own mode where PNG holds it, else as RGB), or a page's own
  error in its place when that page alone cannot be rendered. The same page gives the same bytes
  every time (PNG written by Pillow with fixed options), so a replay of the split stores nothing
  new and identical pages share one content hash.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps

from schemas.errors import ErrorCode
from services.common.errors import OcrError
from services.common.images.imaging import (
    PDF_RENDER_DPI, ImageInfo, _check_pixels, _frame_sizes, _next_frame, _open, _pdf_pixels, flatten,
    pdf_page_sizes,
)
from services.common.documents.pdf_tree import open_pdf

DOCUMENT_FORMATS = ("PDF", "TIFF")
"""The formats split into pages when they hold more than one."""
_PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "I;16")
"""Modes Pillow writes to PNG as they are (a TIFF page keeps its mode, so infer flattens its
transparency as it would have in the TIFF); any other mode is written as RGB."""
PNG_COMPRESS_LEVEL = 1
"""zlib level of the page PNGs: fast to write, a few percent larger than level 6."""


def document_plan(data: bytes | BinaryIO, max_pixels: int, max_pages: int, max_document_pages: int,
                  max_document_pixels: int) -> tuple[ImageInfo, list[tuple[int, int]]]:
    """The header check of an input that may be a document, nothing rendered.

    Args:
        data: The bytes, or a seekable file holding them.
        max_pixels: Largest width x height of one page.
        max_pages: Most frames of an input that is not a document (GIF, WebP, ...).
        max_document_pages: Most pages of a PDF or TIFF.
        max_document_pixels: Most pixels of all pages of a PDF or TIFF together.

    Returns:
        ``(info, sizes)``: ``sizes`` every page's ``(width, height)`` (a PDF's at the render DPI).

    Raises:
        OcrError: ``document_too_many_pages``, ``document_too_large``, ``image_too_large`` (a
            one-page PDF or TIFF over ``max_pixels``; in a longer document that page fails alone at
            its render), ``corrupt_image``, and for other images what
            :func:`~services.common.images.imaging.page_sizes` raises.
    """
    fmt, img, _ = _open(data, max_pixels)
    if img is None:
        return _pdf_plan(data, max_pixels, max_document_pages, max_document_pixels)
    if fmt != "TIFF":  # not a document: the checks of page_sizes, on the image already open
        with img:
            w, h = img.size
            frames = _frame_sizes(img, max_pixels, max_pages)
        return ImageInfo(fmt, w, h, len(frames)), frames
    with img:
        w, h = img.size
        sizes = [img.size]
        try:
            while True:
                try:
                    _next_frame(img)
                except EOFError:
                    break
                if len(sizes) == max_document_pages:
                    raise OcrError(ErrorCode.DOCUMENT_TOO_MANY_PAGES,
                                   f"TIFF has more than {max_document_pages} pages, limit {max_document_pages}")
                sizes.append(img.size)
        except (OcrError, MemoryError):
            raise
        except Exception as exc:  # a later page's header is damaged
            raise OcrError(ErrorCode.CORRUPT_IMAGE, f"a later page's header cannot be read: {exc}") from exc
    _check_document(sizes, max_pixels, max_document_pixels)
    return ImageInfo(fmt, w, h, len(sizes)), sizes


def _pdf_plan(data: bytes | BinaryIO, max_pixels: int, max_document_pages: int,
              max_document_pixels: int) -> tuple[ImageInfo, list[tuple[int, int]]]:
    """A PDF's page count from its page tree, then every page's size (no page loaded or rendered)."""
    sizes = pdf_page_sizes(data, max_document_pages, too_many=ErrorCode.DOCUMENT_TOO_MANY_PAGES)
    _check_document(sizes, max_pixels, max_document_pixels)
    return ImageInfo("PDF", *sizes[0], len(sizes)), sizes


def _check_document(sizes: list[tuple[int, int]], max_pixels: int, max_document_pixels: int) -> None:
    """Pages against ``max_pixels`` and together against ``max_document_pixels``. In a document of
    more than one page a page over ``max_pixels`` is left to fail alone when it would be rendered
    (:func:`render_pages`; it is never rendered, so its pixels do not count in the total); a
    one-page PDF or TIFF (one request) is refused with ``image_too_large`` as any image."""
    total = 0
    for w, h in sizes:
        if len(sizes) == 1 or w * h <= max_pixels:
            _check_pixels(w, h, max_pixels)
            total += w * h
    if total > max_document_pixels:
        raise OcrError(ErrorCode.DOCUMENT_TOO_LARGE,
                       f"the {len(sizes)} pages hold {total} pixels, limit {max_document_pixels}")


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()


Rendered = tuple[bytes, int, int] | OcrError
"""One page of :func:`render_pages`: ``(png, width, height)``, or the error of that page alone."""


def render_pages(data: bytes | BinaryIO, first: int, count: int, max_pixels: int) -> Iterator[Rendered]:
    """Pages ``first`` to ``first + count - 1`` (0-based) of a PDF or TIFF as PNG bytes, one at a time.

    A page that cannot be rendered fails alone: its :class:`OcrError` is yielded in its place
    (``image_too_large``: over ``max_pixels``, checked before it is rendered; ``corrupt_image``:
    damaged page data, e.g. a TIFF frame whose strips do not decode, or a PDF page pdfium cannot
    load or render; ``image_too_complex``: a ``MemoryError`` under the decoder's memory cap), and
    the next page is rendered.

    Yields:
        ``(png, width, height)`` or the page's ``OcrError``, per page, in order (fewer past the last page).

    Raises:
        OcrError: the document as a whole cannot be read: ``corrupt_image`` (it does not open),
            ``unsupported_format`` (not a PDF or TIFF).
    """
    _, opened, _ = _open(data, max_pixels)
    if opened is None:
        yield from _render_pdf_pages(data, first, count, max_pixels)
        return
    with opened as img:
        if img.format != "TIFF":
            raise OcrError(ErrorCode.UNSUPPORTED_FORMAT, f"{img.format} is not split into pages (PDF and TIFF are)")
        for i in range(first, first + count):
            try:
                img.seek(i)
            except EOFError:
                return
            except MemoryError:
                yield OcrError(ErrorCode.IMAGE_TOO_COMPLEX, f"page {i + 1}: its header needs more memory than the decoder has")
                continue
            except Exception as exc:  # noqa: BLE001 - a damaged frame header: this page fails
                yield OcrError(ErrorCode.CORRUPT_IMAGE, f"TIFF page {i + 1} could not be read: {exc}")
                continue
            yield _page_or_error(lambda: _tiff_page(img, i, max_pixels), "TIFF", i)


def _tiff_page(img: Image.Image, i: int, max_pixels: int) -> tuple[bytes, int, int]:
    """Frame ``i`` of an open TIFF (already sought) as ``(png, width, height)``."""
    _check_pixels(*img.size, max_pixels)
    img.load()
    page = ImageOps.exif_transpose(img) if i == 0 else img
    if page.mode not in _PNG_MODES:
        page = flatten(page)[0]
    return _png(page), page.size[0], page.size[1]


def _page_or_error(render: Callable[[], tuple[bytes, int, int]], fmt: str, i: int) -> Rendered:
    """``render()``, or the error of page ``i`` (0-based) that it raised."""
    try:
        return render()
    except OcrError as exc:
        return OcrError(exc.code, f"page {i + 1}: {exc.message}")
    except MemoryError:
        return OcrError(ErrorCode.IMAGE_TOO_COMPLEX, f"page {i + 1} needs more memory than the decoder has")
    except Exception as exc:  # noqa: BLE001 - damaged page data (Pillow's decoder, pdfium): this page fails
        return OcrError(ErrorCode.CORRUPT_IMAGE, f"{fmt} page {i + 1} could not be decoded: {exc}")


def _render_pdf_pages(data: bytes | BinaryIO, first: int, count: int, max_pixels: int) -> Iterator[Rendered]:
    doc = open_pdf(data, pages_needed=first + count)  # pages past an understated /Count too
    try:
        for i in range(first, min(first + count, len(doc))):
            yield _page_or_error(lambda: _pdf_page(doc, i, max_pixels), "PDF", i)
    finally:
        doc.close()


def _pdf_page(doc, i: int, max_pixels: int) -> tuple[bytes, int, int]:
    """Page ``i`` of an open ``pypdfium2.PdfDocument`` rendered onto white, as ``(png, width, height)``."""
    page = doc[i]
    try:
        w, h = _pdf_pixels(*page.get_size())
        _check_pixels(w, h, max_pixels)
        bitmap = page.render(scale=PDF_RENDER_DPI / 72, fill_color=(255, 255, 255, 255), rev_byteorder=True)
        rgb = np.ascontiguousarray(bitmap.to_numpy()[:, :, :3])
    finally:
        page.close()
    return _png(Image.fromarray(rgb, "RGB")), rgb.shape[1], rgb.shape[0]
