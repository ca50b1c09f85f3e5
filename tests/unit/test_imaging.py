"""Sniffing and decoding: every EXIF orientation, every Pillow mode, limits before decoding."""

import io
import tempfile

import numpy as np
import pytest
from PIL import Image

from schemas.errors import ErrorCode
from services.common.errors import OcrError
from services.common.images.imaging import _render_pdf, decode, flatten, iter_flattened, iter_pages, sniff
from tests.pages import png16

BIG = 100_000_000


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def marker_image(w: int = 120, h: int = 80) -> Image.Image:
    """White image with a black block in the top-left corner (to check orientation)."""
    img = Image.new("RGB", (w, h), "white")
    img.paste((0, 0, 0), (0, 0, 30, 20))
    return img


# Pillow's transpose that *stores* an upright image under each EXIF orientation value
_STORE = {
    1: None, 2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_is_applied(orientation):
    upright = marker_image()
    stored = upright if _STORE[orientation] is None else upright.transpose(_STORE[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation
    [page] = decode(encode(stored, "JPEG", exif=exif, quality=95), BIG, 5)
    assert page.shape == (80, 120, 3)
    assert page[:20, :30].mean() < 60, "marker must be top-left after applying EXIF"
    assert page[60:, 90:].mean() > 200


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA", "I;16", "I", "F", "CMYK", "YCbCr"])
def test_every_mode_decodes_to_dark_text_on_white(mode):
    base = marker_image()
    if mode == "I;16":
        arr = np.where(np.asarray(base.convert("L")) > 128, 65535, 0).astype(np.uint16)
        img = Image.fromarray(arr)
        assert img.mode == "I;16"
    elif mode == "I":
        img = Image.fromarray(np.where(np.asarray(base.convert("L")) > 128, 65535, 0).astype(np.int32))
        assert img.mode == "I"
    elif mode == "F":
        img = Image.fromarray(np.where(np.asarray(base.convert("L")) > 128, 1.0, 0.0).astype(np.float32))
        assert img.mode == "F"
    else:
        img = base.convert(mode)
    fmt = {"CMYK": "TIFF", "YCbCr": "TIFF", "I": "TIFF", "F": "TIFF", "LA": "PNG"}.get(mode, "PNG")
    if mode == "YCbCr":
        fmt = "JPEG"
    [page] = decode(encode(img, fmt), BIG, 5)
    assert page.dtype == np.uint8 and page.shape == (80, 120, 3)
    assert page[:20, :30].mean() < 60 and page[40:, 60:].mean() > 200


def test_transparent_background_is_composited_on_white():
    arr = np.zeros((40, 60, 4), dtype=np.uint8)  # fully transparent black
    arr[5:15, 5:25] = (0, 0, 0, 255)  # opaque black text
    [page] = decode(encode(Image.fromarray(arr, "RGBA")), BIG, 5)
    assert page[5:15, 5:25].mean() < 10 and page[30:, 40:].mean() == 255


def _light_on_transparent(mode: str) -> bytes:
    """A 60x40 page, fully transparent (its colour black, where it has one) but for a white
    20x10 block at (5, 5), in ``mode``."""
    ink = np.zeros((40, 60), dtype=np.uint8)
    ink[5:15, 5:25] = 255
    if mode == "RGBA":
        arr = np.zeros((40, 60, 4), dtype=np.uint8)
        arr[..., :3] = ink[..., None]
        arr[..., 3] = ink
        return encode(Image.fromarray(arr, "RGBA"))
    if mode == "LA":
        return encode(Image.fromarray(np.stack([ink, ink], axis=-1), "LA"))
    if mode == "P":
        img = Image.fromarray((ink // 255).astype(np.uint8), "P")
        img.putpalette([0, 0, 0, 255, 255, 255] + [0, 0, 0] * 254)
        return encode(img, "PNG", transparency=0)
    if mode == "I;16 key":
        return encode(Image.fromarray(ink.astype(np.uint16) * 257), "PNG", transparency=0)
    if mode == "RGBA 16-bit":  # transparent pixels white: only alpha tells the block from the ground
        arr = np.full((40, 60, 4), 65535, dtype=np.uint16)
        arr[..., 3] = ink.astype(np.uint16) * 257
        return png16(arr, 6)
    if mode == "LA 16-bit":
        return png16(np.stack([np.full((40, 60), 65535, np.uint16), ink.astype(np.uint16) * 257], axis=-1), 4)
    raise ValueError(mode)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "I;16 key", "RGBA 16-bit", "LA 16-bit"])
def test_light_content_on_transparency_is_flattened_onto_black_and_says_so(mode):
    [(page, background)] = list(iter_flattened(_light_on_transparent(mode), BIG, 5))
    assert background == "black"
    assert page[5:15, 5:25].min() == 255 and page[20:, 30:].max() == 0  # white stays white, the ground black
    [same] = list(iter_pages(_light_on_transparent(mode), BIG, 5))
    assert np.array_equal(same, page)


def test_dark_content_on_transparency_goes_onto_white_and_opaque_pages_report_none():
    arr = np.zeros((40, 60, 4), dtype=np.uint8)
    arr[5:15, 5:25] = (0, 0, 0, 255)
    assert [bg for _, bg in iter_flattened(encode(Image.fromarray(arr, "RGBA")), BIG, 5)] == ["white"]
    arr[..., 3] = 255  # an alpha channel, every pixel opaque: nothing to flatten
    assert [bg for _, bg in iter_flattened(encode(Image.fromarray(arr, "RGBA")), BIG, 5)] == [None]
    assert [bg for _, bg in iter_flattened(encode(marker_image()), BIG, 5)] == [None]
    nothing = Image.new("RGBA", (20, 20), (255, 255, 255, 0))  # fully transparent: white, nothing to read
    rgb, background = flatten(nothing)
    assert background == "white" and np.asarray(rgb).min() == 255


def test_the_background_follows_the_opaque_pixels_not_the_half_transparent_fringe():
    arr = np.zeros((40, 60, 4), dtype=np.uint8)
    arr[5:15, 5:25] = (250, 250, 250, 255)  # light, opaque
    arr[20:40, :] = (0, 0, 0, 100)  # a large dark haze, under half opaque: not content
    rgb, background = flatten(Image.fromarray(arr, "RGBA"))
    assert background == "black" and np.asarray(rgb)[5:15, 5:25].min() == 250


def test_palette_with_transparency_key():
    img = marker_image().convert("P")
    white_index = img.getpixel((100, 70))
    [page] = decode(encode(img, "PNG", transparency=white_index), BIG, 5)
    assert page[40:, 60:].mean() == 255 and page[:20, :30].mean() < 60


def test_sixteen_bit_is_scaled_by_bit_depth_not_clipped():
    img = Image.fromarray(np.full((10, 10), 32896, dtype=np.uint16))  # 32896/257 = 128
    [page] = decode(encode(img), BIG, 5)
    assert int(page[0, 0, 0]) == 128


def test_multi_frame_tiff_gives_every_page():
    frames = [marker_image(), Image.new("RGB", (120, 80), "white"), marker_image()]
    data = encode(frames[0], "TIFF", save_all=True, append_images=frames[1:])
    assert sniff(data, BIG, 5).frames == 3
    pages = decode(data, BIG, 5)
    assert len(pages) == 3 and pages[1].mean() == 255
    with pytest.raises(OcrError) as e:
        decode(data, BIG, 2)
    assert e.value.code is ErrorCode.TOO_MANY_PAGES


def test_limits_and_bad_bytes():
    with pytest.raises(OcrError) as e:
        sniff(b"", BIG, 5)
    assert e.value.code is ErrorCode.EMPTY_INPUT
    with pytest.raises(OcrError) as e:
        sniff(b"hello, I am text pretending to be a png", BIG, 5)
    assert e.value.code is ErrorCode.UNSUPPORTED_FORMAT
    big = encode(Image.new("L", (3000, 3000)))
    with pytest.raises(OcrError) as e:
        sniff(big, 1_000_000, 5)
    assert e.value.code is ErrorCode.IMAGE_TOO_LARGE
    jpeg = encode(marker_image(600, 400), "JPEG")
    with pytest.raises(OcrError) as e:
        decode(jpeg[: len(jpeg) // 2], BIG, 5)
    assert e.value.code is ErrorCode.CORRUPT_IMAGE


def test_pdf_pages_are_rendered():
    img = marker_image(300, 200)
    data = encode(img, "PDF", resolution=72)
    info = sniff(data, BIG, 5)
    assert info.format == "PDF" and info.frames == 1
    [page] = decode(data, BIG, 5)
    h, w = page.shape[:2]
    assert abs(w / h - 1.5) < 0.02 and page[: h // 10, : w // 10].mean() < 60


def test_a_pdf_without_pages_says_so_not_pdfium_success():
    import pypdfium2

    from services.common.images.imaging import pdf_page_sizes

    buf = io.BytesIO()
    pypdfium2.PdfDocument.new().save(buf)  # a page tree with no page: /Count 0 /Kids []
    empty = buf.getvalue()
    no_tree = empty.replace(b"/Pages 2 0 R ", b" " * 13)  # a catalog naming no page tree (same offsets)
    assert no_tree != empty
    for data in (empty, no_tree):
        for read in (lambda: sniff(data, BIG, 5), lambda: pdf_page_sizes(data, 5), lambda: decode(data, BIG, 5)):
            with pytest.raises(OcrError) as e:
                read()
            assert (e.value.code, e.value.message) == (
                ErrorCode.CORRUPT_IMAGE, "the PDF has no pages (no page tree with a page in it)")
    with pytest.raises(OcrError) as e:  # other damage keeps PDFium's own words
        sniff(b"%PDF-1.4\n garbage", BIG, 5)
    assert e.value.message == "PDF could not be opened: Failed to load document (PDFium: Data format error)."


def test_total_pixels_of_all_pages_are_bounded():
    frames = [Image.new("L", (1000, 1000), 255) for _ in range(5)]  # 5 Mpx in a tiny file
    data = encode(frames[0], "TIFF", save_all=True, append_images=frames[1:], compression="tiff_deflate")
    with pytest.raises(OcrError) as e:
        sniff(data, 2_000_000, 20)  # each page fits, all together do not (limit 2 x 2 Mpx)
    assert e.value.code is ErrorCode.IMAGE_TOO_LARGE
    assert len(decode(data, 3_000_000, 20)) == 5


def test_header_damage_is_corrupt_image_and_other_bytes_unsupported():
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    png_0x0 = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")
    for data, fmt in ((png_0x0, "PNG"), (b"\xff\xd8\xff\xe0 not really", "JPEG"), (b"RIFF\0\0\0\0WEBPVP8 ", "WEBP")):
        with pytest.raises(OcrError) as e:
            sniff(data, BIG, 5)
        assert e.value.code is ErrorCode.CORRUPT_IMAGE, fmt
        assert f"starts like a {fmt} file" in str(e.value)


def test_pdf_header_may_follow_other_bytes_but_a_png_holding_it_stays_a_png():
    pdf = encode(marker_image(300, 200), "PDF", resolution=72)
    for prefix in (b"\n", b"\r\n  \t", b"x" * 1000):
        info = sniff(prefix + pdf, BIG, 5)
        assert (info.format, info.frames) == ("PDF", 1)
        assert len(decode(prefix + pdf, BIG, 5)) == 1
    with pytest.raises(OcrError) as e:
        sniff(b"x" * 1100 + pdf, BIG, 5)  # header past the first 1024 bytes: not a PDF
    assert e.value.code is ErrorCode.UNSUPPORTED_FORMAT
    from PIL.PngImagePlugin import PngInfo

    meta = PngInfo()
    meta.add_text("Comment", "%PDF-1.7 is just text here")
    png = encode(marker_image(), "PNG", pnginfo=meta)
    assert b"%PDF-" in png[:1024]
    assert sniff(png, BIG, 5).format == "PNG"


def test_an_image_holding_a_pdf_header_that_no_signature_names_stays_an_image():
    # PPM (and other formats Pillow reads without a fixed signature) may hold "%PDF-" in a
    # header comment or in raw pixel bytes within the first 1024 bytes
    ppm = encode(marker_image(40, 20), "PPM")
    commented = ppm.replace(b"P6\n", b"P6\n# converted from report.pdf (%PDF-1.7)\n", 1)
    pixels = Image.frombytes("RGB", (2, 1), b"%PDF-1")  # two pixels whose bytes read %PDF-1
    raw = encode(pixels, "PPM")
    for data in (commented, raw):
        assert b"%PDF-" in data[:1024]
        info = sniff(data, BIG, 5)
        assert (info.format, info.frames) == ("PPM", 1)
        assert _sniff_both(data)[1:] == [info, info]
        assert decode(data, BIG, 5)[0].shape[2] == 3
    info = sniff(commented, BIG, 5)
    assert (info.width, info.height) == (40, 20)


def _sniff_both(data: bytes, max_pixels: int = BIG, max_pages: int = 5):
    """sniff() of the bytes and of the same bytes in a file (a large HTTP upload's spool file):
    each an ImageInfo or the OcrError code; the file is left open and can be read again."""
    out = []
    with tempfile.TemporaryFile() as f:
        f.write(data)
        for src in (data, f, f):
            try:
                out.append(sniff(src, max_pixels, max_pages))
            except OcrError as e:
                out.append(e.code)
    return out


def test_sniff_of_a_spooled_file_answers_as_sniff_of_the_bytes():
    frames = [marker_image(), Image.new("RGB", (120, 80), "white"), marker_image()]
    tiff3 = encode(frames[0], "TIFF", save_all=True, append_images=frames[1:])
    pdf = encode(marker_image(300, 200), "PDF", resolution=72)
    gif3 = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    cases = {
        "png": (encode(marker_image()), BIG, 5, sniff(encode(marker_image()), BIG, 5)),
        "tiff pages": (tiff3, BIG, 5, sniff(tiff3, BIG, 5)),
        "tiff too many pages": (tiff3, BIG, 2, ErrorCode.TOO_MANY_PAGES),
        "gif too many frames": (gif3, BIG, 2, ErrorCode.TOO_MANY_PAGES),
        "pdf": (pdf, BIG, 5, sniff(pdf, BIG, 5)),
        "pdf cut": (pdf[: len(pdf) // 2], BIG, 5, ErrorCode.CORRUPT_IMAGE),
        "not an image": (b"hello, I am text pretending to be a png", BIG, 5, ErrorCode.UNSUPPORTED_FORMAT),
        "too many pixels": (encode(Image.new("L", (3000, 3000))), 1_000_000, 5, ErrorCode.IMAGE_TOO_LARGE),
        "empty": (b"", BIG, 5, ErrorCode.EMPTY_INPUT),
    }
    for name, (data, px, pages, want) in cases.items():
        assert _sniff_both(data, px, pages) == [want] * 3, name
    assert cases["tiff pages"][3].frames == 3 and cases["pdf"][3].format == "PDF"


def test_a_pixel_limit_above_pillows_own_is_honoured(monkeypatch):
    """Pillow refuses more than 2 x MAX_IMAGE_PIXELS (~179 M) by itself; a deployment that allows
    more (OCRSTREAM_LIMITS__MAX_PIXELS) must get its own limit, not Pillow's."""
    import struct
    import zlib

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 89_478_485)  # Pillow's default, whatever ran before; restored after

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    header = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20_000, 20_000, 8, 0, 0, 0, 0))
              + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))  # 400 M pixels
    with pytest.raises(OcrError) as exc:
        sniff(header, 100_000_000, 20)
    assert exc.value.code is ErrorCode.IMAGE_TOO_LARGE
    info = sniff(header, 500_000_000, 20)
    assert (info.format, info.width, info.height) == ("PNG", 20_000, 20_000)
    with pytest.raises(OcrError) as exc:
        sniff(header, 399_999_999, 20)
    assert exc.value.message == "20000x20000 = 400000000 pixels exceeds the limit of 399999999"



def small_first_page_pdf() -> bytes:
    """A 4-page PDF of blank pages (913 bytes): page 1 is 10 x 10 pt (28 x 28 px at 200 dpi),
    pages 2-4 are 1000 x 1000 pt (2778 x 2778 = 7,717,284 px each)."""
    import pypdfium2 as pdfium

    pdf = pdfium.PdfDocument.new()
    for side in (10, 1000, 1000, 1000):
        pdf.new_page(side, side)
    buf = io.BytesIO()
    pdf.save(buf)
    return buf.getvalue()


def test_pdf_pages_after_a_tiny_first_page_count_towards_the_total():
    data = small_first_page_pdf()
    # each page fits 8 Mpx; all four (784 + 3 x 7,717,284 = 23,152,636 px) do not fit 2 x 8 Mpx.
    # Page 1 x 4 pages (3,136 px) would pass: every page must be counted, in sniff (ingest,
    # before any decode) and again in _render_pdf (infer) before each page is rendered.
    for check in (lambda: sniff(data, 8_000_000, 20), lambda: decode(data, 8_000_000, 20),
                  lambda: list(_render_pdf(data, 8_000_000))):
        with pytest.raises(OcrError) as e:
            check()
        assert e.value.code is ErrorCode.IMAGE_TOO_LARGE
        assert e.value.message == "all pages hold 23152636 pixels, limit 16000000"
    info = sniff(data, 12_000_000, 20)  # limit 24 Mpx: the same file passes
    assert (info.format, info.width, info.height, info.frames) == ("PDF", 28, 28, 4)
    assert [p.shape for p in decode(data, 12_000_000, 20)] == [(28, 28, 3)] + [(2778, 2778, 3)] * 3


def test_a_multi_page_tiff_whose_second_page_is_broken_is_corrupt_image():
    """Counting a TIFF's frames reads every page's header: page 2 with an unknown
    PhotometricInterpretation (Pillow: SyntaxError "unknown pixel mode") is the image's
    ``corrupt_image``, not an internal error (which the HTTP door would answer 503)."""
    import struct

    buf = io.BytesIO()
    Image.new("L", (32, 32), 255).save(buf, "TIFF", save_all=True, append_images=[Image.new("L", (32, 32), 0)])
    data = bytearray(buf.getvalue())
    ifd1 = struct.unpack_from("<I", data, 4)[0]
    n = struct.unpack_from("<H", data, ifd1)[0]
    ifd2 = struct.unpack_from("<I", data, ifd1 + 2 + 12 * n)[0]
    for i in range(struct.unpack_from("<H", data, ifd2)[0]):
        off = ifd2 + 2 + 12 * i
        if struct.unpack_from("<H", data, off)[0] == 262:  # PhotometricInterpretation
            struct.pack_into("<H", data, off + 8, 99)
    with pytest.raises(OcrError) as err:
        sniff(bytes(data), 100_000_000, 20)
    assert err.value.code == ErrorCode.CORRUPT_IMAGE
    assert "unknown pixel mode" in str(err.value)


def test_unsupported_format_says_which_formats_are_read():
    from schemas.errors import ERRORS
    from services.common.images.imaging import ACCEPTED_FORMATS, READ_FORMATS

    assert READ_FORMATS == "PNG, JPEG, GIF, TIFF, BMP, WebP, PBM/PGM/PPM, JPEG 2000, AVIF or PDF"
    assert len(READ_FORMATS.split(", ")) == len(ACCEPTED_FORMATS)  # each format named once, PDF with the last
    for data in (b"%!PS-Adobe-3.0 EPSF", b"just some words, not an image\n", b"8BPS\0\1 a PSD"):
        with pytest.raises(OcrError) as e:
            sniff(data, BIG, 5)
        assert e.value.code is ErrorCode.UNSUPPORTED_FORMAT
        assert e.value.message == ("not an image format ocrstream reads; it reads PNG, JPEG, GIF, TIFF, BMP, WebP, "
                                   "PBM/PGM/PPM, JPEG 2000, AVIF or PDF (recognised from the bytes, not the name)")
    assert READ_FORMATS in ERRORS["unsupported_format"].meaning  # the error table lists the same
