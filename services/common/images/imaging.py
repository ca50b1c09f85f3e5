"""Image sniffing (header only) and decoding to upright 8-bit RGB pages.

Only the formats in :data:`ACCEPTED_FORMATS` are opened, recognised from the bytes (never the
file name or content type); PDFs are rendered page by page with pypdfium2. Limits are checked
from the header before any pixel is decoded, so a decompression bomb costs a few KiB of memory,
and every check costs time linear in the page limit at worst (frames are counted up to
``max_pages + 1``, never to the end of the file).

These functions run in-process and are unbounded in wall-clock time and memory for a hostile
file (a PDF page whose content stream is unbounded work); the stages call them only through
:mod:`services.common.images.decoding`, which runs them in killable worker processes.

Decoding rules (each fixes a whole class of inputs, see ``../shared/cases``):

* EXIF orientation 1-8 is applied (``ImageOps.exif_transpose``); boxes refer to the upright image.
* Alpha (LA, RGBA, PA, P/L/RGB/I;16 with a transparency key; 16-bit alpha as Pillow reduces
  it to 8 bits) is composited onto white or black, whichever contrasts with the page's opaque
  content: light content (a white logo on a transparent PNG) goes onto black, dark content
  onto white (:func:`flatten`). The choice is reported per page (:func:`iter_flattened`).
* 16-bit (I;16*) is scaled by its bit depth (value / 257); 32-bit int (I) and float (F) modes
  are scaled by their actual range (Pillow gives no bit depth for them).
* CMYK, YCbCr, LAB, HSV, 1, L, P are converted to RGB with Pillow's colour conversion.
* Every frame of a multi-frame image (TIFF pages, GIF/APNG/WebP frames) becomes a page.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps, ImageStat

from schemas.errors import ErrorCode
from services.common.errors import OcrError
from services.common.documents.pdf_tree import open_pdf

PDF_MAGIC = b"%PDF-"
PDF_HEADER_WINDOW = 1024
"""A PDF's ``%PDF-`` header may follow other bytes, within the first 1024 (ISO 32000-1:2008,
Annex H.3, implementation note 13; pdfium searches the same window)."""
SIGNATURES = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF",
              b"II*\x00": "TIFF", b"MM\x00*": "TIFF", b"BM": "BMP"}
"""Leading bytes of the raster formats ocrstream reads (PNG, JPEG, GIF, TIFF, BMP; WebP is
``RIFF....WEBP``): a file that starts like one but does not open is ``corrupt_image``, anything
else ``unsupported_format``."""
ACCEPTED_FORMATS = ("PNG", "JPEG", "GIF", "TIFF", "BMP", "WEBP", "PPM", "JPEG2000", "AVIF")
"""The Pillow plugins ocrstream opens (PDF is read by pypdfium2). JPEG includes MPO (a JPEG
with a second picture, from phone cameras: Pillow's JPEG plugin opens it, as format ``MPO``);
PPM covers PBM/PGM/PPM/PNM. Everything else Pillow could open
(PostScript/EPS, which would run Ghostscript where it is installed; PSD, TGA, ICO, and the rest)
is ``unsupported_format``: fewer decoders, fewer ways in."""
FORMAT_NAMES = {"WEBP": "WebP", "PPM": "PBM/PGM/PPM", "JPEG2000": "JPEG 2000"}
"""How messages name the formats of :data:`ACCEPTED_FORMATS` whose Pillow name is not the usual one."""
READ_FORMATS = ", ".join(FORMAT_NAMES.get(f, f) for f in ACCEPTED_FORMATS) + " or PDF"
"""Every format ocrstream reads, as ``unsupported_format`` messages list them: ``PNG, JPEG, GIF, TIFF,
BMP, WebP, PBM/PGM/PPM, JPEG 2000, AVIF or PDF``."""
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


def _head(data: bytes | BinaryIO) -> tuple[bytes, BinaryIO]:
    """The first :data:`PDF_HEADER_WINDOW` bytes and a file positioned at the start."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data[:PDF_HEADER_WINDOW]), io.BytesIO(data)
    data.seek(0)
    head = data.read(PDF_HEADER_WINDOW)
    data.seek(0)
    return head, data


def _open(data: bytes | BinaryIO, max_pixels: int) -> tuple[str, Image.Image | None, bytes]:
    """``("PDF", None, head)`` for a PDF, else ``(format, opened image, head)``.

    Raises:
        OcrError: ``empty_input``, ``unsupported_format``, ``corrupt_image`` or ``image_too_large``
            (Pillow's own bomb check).
    """
    head, src = _head(data)
    if not head:
        raise OcrError(ErrorCode.EMPTY_INPUT, "the image has zero bytes")
    if head.startswith(PDF_MAGIC):
        return "PDF", None, head
    if max_pixels > (Image.MAX_IMAGE_PIXELS or max_pixels):
        # Pillow's own bomb check (an error above 2x MAX_IMAGE_PIXELS, ~179 M by default) would
        # refuse images this deployment allows; ours (_check_pixels) runs right after the header.
        Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(src, formats=ACCEPTED_FORMATS)
    except Image.DecompressionBombError as exc:
        raise OcrError(ErrorCode.IMAGE_TOO_LARGE, str(exc)) from exc
    except MemoryError:
        raise
    except Exception as exc:
        if is_pdf(head):  # "%PDF-" after other bytes, and no image reader took the file
            src.seek(0)
            return "PDF", None, head
        if fmt := _raster_signature(head):
            raise OcrError(ErrorCode.CORRUPT_IMAGE, f"starts like a {fmt} file but its header cannot be read") from exc
        raise OcrError(ErrorCode.UNSUPPORTED_FORMAT, f"not an image format ocrstream reads; it reads {READ_FORMATS} "
                                                     "(recognised from the bytes, not the name)") from exc
    return img.format or "unknown", img, head


def _next_frame(img: Image.Image) -> None:
    """Move ``img`` to its next frame reading headers only; EOFError past the last one.

    GIF's public ``seek`` decodes every frame it passes (for disposal), so GIF uses Pillow's
    header-only step (``_seek(frame, False)``, what its own ``n_frames`` uses)."""
    if img.format == "GIF":
        img._seek(img.tell() + 1, False)  # noqa: SLF001 - Pillow 13 GifImageFile
    else:
        img.seek(img.tell() + 1)


def _frame_sizes(img: Image.Image, max_pixels: int, max_pages: int) -> list[tuple[int, int]]:
    """``(width, height)`` of every frame in order, reading at most ``max_pages + 1`` headers.

    Pillow's ``n_frames`` walks every header to the end of the file, and for TIFF its loop check
    is a list search per page (quadratic: 100,000 chained headers took 94 s); here the walk stops
    at the limit, so the cost is linear in ``max_pages`` whatever the file holds.

    Raises:
        OcrError: ``too_many_pages``, ``corrupt_image`` (a later header cannot be read),
            ``image_too_large`` (a page, or all pages together, over the pixel limits).
    """
    sizes = [img.size]
    _check_pixels(*img.size, max_pixels)
    total = img.size[0] * img.size[1]
    try:
        while True:
            try:
                _next_frame(img)
            except EOFError:
                break
            if len(sizes) == max_pages:
                raise OcrError(ErrorCode.TOO_MANY_PAGES, f"image has more than {max_pages} frames, limit {max_pages}")
            sizes.append(img.size)
            _check_pixels(*img.size, max_pixels)
            total += img.size[0] * img.size[1]
            _check_total(total, max_pixels)
    except (OcrError, MemoryError):  # a MemoryError is the decoder's limit, not damage
        raise
    except Exception as exc:  # a later page's header is damaged
        raise OcrError(ErrorCode.CORRUPT_IMAGE, f"a later page's header cannot be read: {exc}") from exc
    _check_total(total, max_pixels)
    return sizes


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
    fmt, img, _ = _open(data, max_pixels)
    if img is None:
        sizes = _pdf_sizes(data, max_pixels, max_pages)
        return ImageInfo("PDF", *sizes[0], len(sizes))
    with img:
        w, h = img.size
        sizes = _frame_sizes(img, max_pixels, max_pages)
        return ImageInfo(fmt, w, h, len(sizes))


def page_sizes(data: bytes | BinaryIO, max_pixels: int, max_pages: int) -> tuple[ImageInfo, list[tuple[int, int]]]:
    """:func:`sniff`, plus the ``(width, height)`` of every page from its header, a PDF's at
    :data:`PDF_RENDER_DPI`: what :func:`iter_pages` will give, except that page 1 may come out a
    quarter turned by its EXIF orientation (the same pixels, the sides swapped). The orientation
    is not read here: a PNG's EXIF may follow its pixels, and Pillow decodes them to find it.

    Raises:
        OcrError: as :func:`sniff`.
    """
    fmt, img, _ = _open(data, max_pixels)
    if img is None:
        sizes = _pdf_sizes(data, max_pixels, max_pages)
        return ImageInfo("PDF", *sizes[0], len(sizes)), sizes
    with img:
        w, h = img.size
        sizes = _frame_sizes(img, max_pixels, max_pages)
    return ImageInfo(fmt, w, h, len(sizes)), sizes


def pdf_page_sizes(data: bytes | BinaryIO, max_pages: int,
                   too_many: ErrorCode = ErrorCode.TOO_MANY_PAGES) -> list[tuple[int, int]]:
    """Every page's ``(width, height)`` in pixels at :data:`PDF_RENDER_DPI`, read from the page
    tree (no page is loaded or rendered). The pages are those the tree holds, counted leaf by
    leaf where its ``/Count`` says otherwise (:func:`~services.common.documents.pdf_tree.open_pdf`).

    Raises:
        OcrError: ``corrupt_image`` (no pages, or a page the tree names cannot be read);
            ``too_many`` when the tree holds more than ``max_pages`` pages.
    """
    doc = open_pdf(data, walk_tree=True)
    try:
        n = len(doc)
        if n == 0:
            raise OcrError(ErrorCode.CORRUPT_IMAGE, "PDF has no pages")
        if n > max_pages:
            raise OcrError(too_many, f"PDF has {n} pages, limit {max_pages}")
        sizes = []
        for i in range(n):
            try:
                sizes.append(_pdf_pixels(*doc.get_page_size(i)))
            except Exception as exc:  # pdfium: the page tree names a page it cannot find
                raise OcrError(ErrorCode.CORRUPT_IMAGE, f"PDF page {i + 1} could not be read: {exc}") from exc
    finally:
        doc.close()
    return sizes


def _pdf_sizes(data: bytes | BinaryIO, max_pixels: int, max_pages: int) -> list[tuple[int, int]]:
    """Every page's rendered size from the page tree (no page is loaded or rendered): a tiny
    page 1 must not vouch for the rest. :func:`iter_pages` checks the same again while rendering."""
    sizes = pdf_page_sizes(data, max_pages)
    total = 0
    for w, h in sizes:
        _check_pixels(w, h, max_pixels)
        total += w * h
        _check_total(total, max_pixels)
    return sizes


def _pdf_pixels(w_pt: float, h_pt: float) -> tuple[int, int]:
    """Width and height in pixels of a PDF page of ``w_pt`` x ``h_pt`` points rendered at
    :data:`PDF_RENDER_DPI` (72 points per inch, ISO 32000-1:2008 section 8.3.2.3), rounded up as
    pypdfium2 5's ``PdfPage.render`` rounds them (``math.ceil(width * scale)``)."""
    scale = PDF_RENDER_DPI / 72
    return math.ceil(w_pt * scale), math.ceil(h_pt * scale)


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


ALPHA_OPAQUE = 128
"""Alpha from which a pixel counts as content when :func:`flatten` judges its brightness (the
anti-aliased fringe of a glyph, half transparent or more, does not count)."""
LIGHT_CONTENT = 127.5
"""Mean luma (ITU-R BT.601, 0-255) of the opaque pixels above which content counts as light and
goes onto black: whichever background is farther from the content's mean."""
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
BACKGROUNDS = ("white", "black")
"""The colours :func:`flatten` composites transparent pixels onto."""


def flatten(img: Image.Image) -> tuple[Image.Image, str | None]:
    """Convert one frame of any Pillow mode to 8-bit RGB, transparency composited onto the
    background that keeps its content visible.

    The background is black when the mean luma of the frame's opaque pixels (alpha of at least
    :data:`ALPHA_OPAQUE`; all non-transparent ones if none is) is above :data:`LIGHT_CONTENT`, white
    otherwise (and for a frame with nothing opaque at all). Light text on a transparent
    background thus stays light on black, dark text stays dark on white; a frame whose pixels
    are all opaque is converted as it is.

    Args:
        img: One loaded frame, any mode.

    Returns:
        ``(rgb, background)``: the RGB image and ``"white"`` or ``"black"`` when the frame has
        at least one pixel that is not fully opaque, else None.
    """
    mode = img.mode
    if mode.startswith("I;16"):
        arr = np.asarray(img, dtype=np.uint16)
        gray = Image.fromarray((arr.astype(np.float32) / 257.0).round().clip(0, 255).astype(np.uint8), "L")
        key = img.info.get("transparency")
        if isinstance(key, int) and not isinstance(key, bool):
            alpha = Image.fromarray(np.where(arr == key, 0, 255).astype(np.uint8), "L")
            return _composite(Image.merge("LA", (gray, alpha)).convert("RGBA"))
        return gray.convert("RGB"), None
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
        return Image.fromarray(scaled.round().clip(0, 255).astype(np.uint8), "L").convert("RGB"), None
    if mode in _ALPHA_MODES or "transparency" in img.info:
        return _composite(img.convert("RGBA"))
    if mode == "RGB":
        return img, None
    return img.convert("RGB"), None


def _composite(rgba: Image.Image) -> tuple[Image.Image, str | None]:
    """``rgba`` onto the background :func:`flatten` chooses (all in Pillow's C code: no
    full-page float copies, so a 36 Mpx page costs a few bytes per pixel)."""
    alpha = rgba.getchannel("A")
    lo, _ = alpha.getextrema()
    if lo == 255:
        return rgba.convert("RGB"), None
    luma = rgba.convert("RGB").convert("L")
    mean = None
    for cut in (ALPHA_OPAQUE, 1):
        mask = alpha.point(lambda v, c=cut: 255 if v >= c else 0)
        if mask.getbbox() is not None:
            mean = ImageStat.Stat(luma, mask).mean[0]
            break
    background = "black" if mean is not None and mean > LIGHT_CONTENT else "white"
    fill = (0, 0, 0, 255) if background == "black" else (255, 255, 255, 255)
    return Image.alpha_composite(Image.new("RGBA", rgba.size, fill), rgba).convert("RGB"), background


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert one frame of any Pillow mode to 8-bit RGB (:func:`flatten` without the choice)."""
    return flatten(img)[0]


def iter_flattened(data: bytes | BinaryIO, max_pixels: int, max_pages: int) -> Iterator[tuple[np.ndarray, str | None]]:
    """:func:`iter_pages`, with the background each page's transparency was flattened onto.

    Yields:
        ``(page, background)`` per page in order: the page as :func:`iter_pages` yields it and
        ``"white"``/``"black"`` (:func:`flatten`), or None for a page without transparency
        (PDF pages are rendered onto white and report None).

    Raises:
        OcrError: as :func:`iter_pages`.
    """
    info = sniff(data, max_pixels, max_pages)
    if info.format == "PDF":
        for page in _render_pdf(data, max_pixels):
            yield page, None
        return
    _, src = _head(data)
    total = 0
    try:
        with Image.open(src, formats=ACCEPTED_FORMATS) as img:
            for i in range(info.frames):
                if i:
                    img.seek(i)
                _check_pixels(img.size[0], img.size[1], max_pixels)
                total += img.size[0] * img.size[1]
                _check_total(total, max_pixels)
                img.load()
                upright = ImageOps.exif_transpose(img) if i == 0 else img
                rgb, background = flatten(upright)
                yield np.asarray(rgb, dtype=np.uint8), background
    except (OcrError, MemoryError):  # a MemoryError is the decoder's limit, not damage
        raise
    except Exception as exc:  # truncated data, bad Huffman tables, broken chunks ...
        raise OcrError(ErrorCode.CORRUPT_IMAGE, f"{info.format} image data could not be decoded: {exc}") from exc


def iter_pages(data: bytes | BinaryIO, max_pixels: int, max_pages: int) -> Iterator[np.ndarray]:
    """Decode every page/frame to an upright RGB array, one at a time (the caller may store each
    page before the next is decoded, so at most one page's pixels are held here).

    Args:
        data: The raw image or PDF bytes, or a seekable binary file holding them.
        max_pixels: Largest width x height allowed per page (checked before decoding).
        max_pages: Most pages/frames allowed.

    Yields:
        One ``uint8`` array of shape ``(height, width, 3)`` per page, in page order.

    Raises:
        OcrError: as :func:`sniff`, plus ``corrupt_image`` when the pixel data cannot be
            decoded (truncated or damaged files).
    """
    for page, _ in iter_flattened(data, max_pixels, max_pages):
        yield page


def decode(data: bytes | BinaryIO, max_pixels: int, max_pages: int) -> list[np.ndarray]:
    """Every page of :func:`iter_pages` in a list (in-process: benchmarks and tests; the stages
    decode through :class:`services.common.images.decoding.DecoderPool`)."""
    return [np.array(p, copy=True) for p in iter_pages(data, max_pixels, max_pages)]


def _render_pdf(data: bytes | BinaryIO, max_pixels: int) -> Iterator[np.ndarray]:
    """Render every page at :data:`PDF_RENDER_DPI` to RGB arrays, one at a time.

    Each page's size is checked before it is rendered: alone against ``max_pixels``, and the
    running total of all pages so far against :data:`TOTAL_PIXELS_FACTOR` x ``max_pixels``
    (``image_too_large``), so a PDF whose later pages are huge is refused before they cost
    memory, whatever page 1 says.
    """
    doc = open_pdf(data, walk_tree=True)
    try:
        total = 0
        for page in doc:
            w, h = _pdf_pixels(*page.get_size())
            _check_pixels(w, h, max_pixels)
            total += w * h
            _check_total(total, max_pixels)
            bitmap = page.render(scale=PDF_RENDER_DPI / 72, fill_color=(255, 255, 255, 255), rev_byteorder=True)
            arr = bitmap.to_numpy()
            yield np.ascontiguousarray(arr[:, :, :3]) if arr.shape[2] != 3 else np.ascontiguousarray(arr)
    finally:
        doc.close()
