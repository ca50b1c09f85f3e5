"""Image sniffing (header only) and decoding to upright 8-bit RGB pages.

Every format Pillow reads is accepted, recognised from the bytes (never the file name or
content type); PDFs are rendered page by page with pypdfium2. Limits are checked from the
header before any pixel is decoded, so a decompression bomb costs a few KiB of memory.

Decoding rules (each fixes a whole class of inputs, see ``../shared/cases``):

* EXIF orientation 1-8 is applied (``ImageOps.exif_transpose``); boxes refer to the upright image.
* Alpha (LA, RGBA, PA, P or L with a transparency key) is composited onto white.
* 16-bit (I;16*) is scaled by its bit depth (value / 257); 32-bit int (I) and float (F) modes
  are scaled by their actual range (Pillow gives no bit depth for them).
* CMYK, YCbCr, LAB, HSV, 1, L, P are converted to RGB with Pillow's colour conversion.
* Every frame of a multi-frame image (TIFF pages, GIF/APNG/WebP frames) becomes a page.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps, ImageSequence

from schemas.errors import ErrorCode
from services.common.errors import OcrError
from services.common.telemetry import traced

PDF_MAGIC = b"%PDF-"
PDF_HEADER_WINDOW = 1024
"""A PDF's ``%PDF-`` header may follow other bytes, within the first 1024 (ISO 32000-1:2008,
Annex H.3, implementation note 13; pdfium searches the same window)."""
SIGNATURES = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF",
              b"II*\x00": "TIFF", b"MM\x00*": "TIFF", b"BM": "BMP"}
"""Leading bytes of the raster formats ocrstream reads (PNG, JPEG, GIF, TIFF, BMP; WebP is
``RIFF....WEBP``): a file that starts like one but does not open is ``corrupt_image``, anything
else ``unsupported_format``."""
PDF_RENDER_DPI = 200
TOTAL_PIXELS_FACTOR = 2
"""All pages of one input together may hold at most this many times ``max_pixels`` (a small
multi-page file must not decode to gigabytes)."""


@dataclass(frozen=True)
class ImageInfo:
    """What the header says: ``format`` (Pillow's name or ``PDF``), size of page 1 in pixels
    (before EXIF rotation) and the number of pages/frames."""

    format: str
    width: int
    height: int
    frames: int


def _pdf_document(data: bytes | BinaryIO):
    import pypdfium2 as pdfium  # imported lazily: only PDFs need it

    try:
        return pdfium.PdfDocument(data)
    except Exception as exc:  # pdfium raises PdfiumError for damaged files
        raise OcrError(ErrorCode.CORRUPT_IMAGE, f"PDF could not be opened: {exc}") from exc


def is_pdf(data: bytes) -> bool:
    """Whether ``data`` may be a PDF: ``%PDF-`` within its first :data:`PDF_HEADER_WINDOW` bytes
    (and not a raster image that merely holds those bytes, say in a PNG text chunk). Only a
    file starting with ``%PDF-`` is surely one: :func:`sniff` takes any other file as an image
    first if Pillow reads it (a PPM comment or raw pixels may hold ``%PDF-`` too)."""
    if data.startswith(PDF_MAGIC):
        return True
    return PDF_MAGIC in data[:PDF_HEADER_WINDOW] and _raster_signature(data) is None


def _raster_signature(data: bytes) -> str | None:
    """The raster format ``data`` starts like (its :data:`SIGNATURES` name, or ``WEBP``), else None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for sig, name in SIGNATURES.items() if data.startswith(sig)), None)


def sniff(data: bytes | BinaryIO, max_pixels: int, max_pages: int) -> ImageInfo:
    """Identify the image from its bytes and check the limits without decoding pixels.

    Args:
        data: The raw upload, or a seekable binary file holding it (a large upload spooled to
            disk); the file is read from its start and left open. Same checks, same errors.
        max_pixels: Largest width x height allowed per page.
        max_pages: Most pages/frames allowed.

    Returns:
        The header information.

    Raises:
        OcrError: ``empty_input``, ``unsupported_format``, ``corrupt_image``,
            ``image_too_large`` or ``too_many_pages``.
    """
    if isinstance(data, (bytes, bytearray)):
        head, src = data[:PDF_HEADER_WINDOW], None
    else:
        data.seek(0)
        head, src = data.read(PDF_HEADER_WINDOW), data
        data.seek(0)
    if not head:
        raise OcrError(ErrorCode.EMPTY_INPUT, "the image has zero bytes")
    if head.startswith(PDF_MAGIC):
        return _sniff_pdf(data, max_pixels, max_pages)
    if max_pixels > (Image.MAX_IMAGE_PIXELS or max_pixels):
        # Pillow's own bomb check (an error above 2x MAX_IMAGE_PIXELS, ~179 M by default) would
        # refuse images this deployment allows; ours (_check_pixels) runs right after the header.
        Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data) if src is None else src)
    except Image.DecompressionBombError as exc:
        raise OcrError(ErrorCode.IMAGE_TOO_LARGE, str(exc)) from exc
    except Exception as exc:
        if is_pdf(head):  # "%PDF-" after other bytes, and no image reader took the file
            if src is not None:
                src.seek(0)
            return _sniff_pdf(data, max_pixels, max_pages)
        if fmt := _raster_signature(head):
            raise OcrError(ErrorCode.CORRUPT_IMAGE, f"starts like a {fmt} file but its header cannot be read") from exc
        raise OcrError(ErrorCode.UNSUPPORTED_FORMAT, "not an image format ocrstream reads") from exc
    with img:
        w, h = img.size
        _check_pixels(w, h, max_pixels)
        try:  # counting frames reads every page's header: a later page can be the broken one
            frames = getattr(img, "n_frames", 1) or 1
        except Exception as exc:
            raise OcrError(ErrorCode.CORRUPT_IMAGE, f"a later page's header cannot be read: {exc}") from exc
        if frames > max_pages:
            raise OcrError(ErrorCode.TOO_MANY_PAGES, f"image has {frames} frames, limit {max_pages}")
        _check_total(w * h * frames, max_pixels)
        return ImageInfo(img.format or "unknown", w, h, frames)


def _sniff_pdf(data: bytes | BinaryIO, max_pixels: int, max_pages: int) -> ImageInfo:
    doc = _pdf_document(data)
    try:
        n = len(doc)
        if n == 0:
            raise OcrError(ErrorCode.CORRUPT_IMAGE, "PDF has no pages")
        if n > max_pages:
            raise OcrError(ErrorCode.TOO_MANY_PAGES, f"PDF has {n} pages, limit {max_pages}")
        # Every page's size from the page tree (no page is loaded or rendered): a tiny page 1
        # must not vouch for the rest. _render_pdf checks the same again while rendering.
        sizes = []
        for i in range(n):
            try:
                sizes.append(_pdf_pixels(*doc.get_page_size(i)))
            except Exception as exc:  # pdfium: the page tree names a page it cannot find
                raise OcrError(ErrorCode.CORRUPT_IMAGE, f"PDF page {i + 1} could not be read: {exc}") from exc
    finally:
        doc.close()
    total = 0
    for w, h in sizes:
        _check_pixels(w, h, max_pixels)
        total += w * h
        _check_total(total, max_pixels)
    w, h = sizes[0]
    return ImageInfo("PDF", w, h, n)


def _pdf_pixels(w_pt: float, h_pt: float) -> tuple[int, int]:
    """Width and height in pixels of a PDF page of ``w_pt`` x ``h_pt`` points rendered at
    :data:`PDF_RENDER_DPI` (72 points per inch, ISO 32000-1:2008 section 8.3.2.3)."""
    return round(w_pt * PDF_RENDER_DPI / 72), round(h_pt * PDF_RENDER_DPI / 72)


def _check_total(total: int, max_pixels: int) -> None:
    if total > TOTAL_PIXELS_FACTOR * max_pixels:
        raise OcrError(ErrorCode.IMAGE_TOO_LARGE,
                       f"all pages hold {total} pixels, limit {TOTAL_PIXELS_FACTOR * max_pixels}")


def _check_pixels(w: int, h: int, max_pixels: int) -> None:
    if w < 1 or h < 1:
        raise OcrError(ErrorCode.CORRUPT_IMAGE, f"image size {w}x{h} is empty")
    if w * h > max_pixels:
        raise OcrError(
            ErrorCode.IMAGE_TOO_LARGE, f"{w}x{h} = {w * h} pixels exceeds the limit of {max_pixels}"
        )


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert one frame of any Pillow mode to 8-bit RGB, alpha composited onto white."""
    mode = img.mode
    if mode.startswith("I;16"):
        arr = np.asarray(img, dtype=np.uint16).astype(np.float32) / 257.0
        return Image.fromarray(arr.round().clip(0, 255).astype(np.uint8), "L").convert("RGB")
    if mode in ("I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        lo, hi = float(arr.min()), float(arr.max())
        if mode == "I" and lo >= 0 and hi <= 255:
            scaled = arr
        elif mode == "I" and lo >= 0 and hi <= 65535:
            scaled = arr / 257.0
        elif mode == "F" and lo >= 0 and hi <= 1.0:
            scaled = arr * 255.0
        else:
            scaled = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
        return Image.fromarray(scaled.round().clip(0, 255).astype(np.uint8), "L").convert("RGB")
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info
    if has_alpha:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if mode == "RGB":
        return img
    return img.convert("RGB")


@traced("decode")
def decode(data: bytes, max_pixels: int, max_pages: int) -> list[np.ndarray]:
    """Decode every page/frame to an upright RGB array.

    Args:
        data: The raw image or PDF bytes.
        max_pixels: Largest width x height allowed per page (checked before decoding).
        max_pages: Most pages/frames allowed.

    Returns:
        One ``uint8`` array of shape ``(height, width, 3)`` per page, in page order.

    Raises:
        OcrError: as :func:`sniff`, plus ``corrupt_image`` when the pixel data cannot be
            decoded (truncated or damaged files).
    """
    info = sniff(data, max_pixels, max_pages)
    if info.format == "PDF":
        return _render_pdf(data, max_pixels)
    pages: list[np.ndarray] = []
    total = 0
    try:
        with Image.open(io.BytesIO(data)) as img:
            for frame in ImageSequence.Iterator(img):
                _check_pixels(frame.size[0], frame.size[1], max_pixels)
                total += frame.size[0] * frame.size[1]
                _check_total(total, max_pixels)
                frame.load()
                upright = ImageOps.exif_transpose(frame) if len(pages) == 0 else frame
                pages.append(np.asarray(to_rgb(upright), dtype=np.uint8).copy())
    except OcrError:
        raise
    except Exception as exc:  # truncated data, bad Huffman tables, broken chunks ...
        raise OcrError(ErrorCode.CORRUPT_IMAGE, f"{info.format} image data could not be decoded: {exc}") from exc
    return pages


def _render_pdf(data: bytes, max_pixels: int) -> list[np.ndarray]:
    """Render every page at :data:`PDF_RENDER_DPI` to RGB arrays.

    Each page's size is checked before it is rendered: alone against ``max_pixels``, and the
    running total of all pages so far against :data:`TOTAL_PIXELS_FACTOR` x ``max_pixels``
    (``image_too_large``), so a PDF whose later pages are huge is refused before they cost
    memory, whatever page 1 says.
    """
    doc = _pdf_document(data)
    try:
        pages = []
        total = 0
        for page in doc:
            w, h = _pdf_pixels(*page.get_size())
            _check_pixels(w, h, max_pixels)
            total += w * h
            _check_total(total, max_pixels)
            bitmap = page.render(scale=PDF_RENDER_DPI / 72, fill_color=(255, 255, 255, 255))
            pages.append(np.asarray(bitmap.to_pil().convert("RGB"), dtype=np.uint8).copy())
        return pages
    finally:
        doc.close()
