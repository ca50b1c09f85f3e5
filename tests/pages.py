"""Generated pages of the kinds the pipeline must read at least as well as the raw engine,
each with the lines it holds: light text on transparent backgrounds (RGBA, LA,
palette, 16-bit), independent columns, words whose spaces the recogniser tends to drop, a
6000x160 banner, and side-by-side regions whose lines share a height (two groups of form
fields, a short label beside a longer line).

Used by the accuracy tests (``tests/integration/test_accuracy.py``) and by the CER bench
(``bench/engine_cer.py``), so both read exactly the same pages. Nothing here is committed as
an image file: every page is drawn from text with the machine's TrueType font
(:func:`tests.conftest.font`).
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from tests.conftest import font


@dataclass(frozen=True)
class Page:
    """One generated page: a ``name``, its ``kind`` (a row of the bench's table), the encoded
    ``data`` and the ``lines`` it holds, in reading order."""

    name: str
    kind: str
    data: bytes
    lines: tuple[str, ...]


ALPHA_LINES = ("WHITE LOGO 2024", "OVERLAY TEXT 77")
COLUMN_LEFT = ("NORTH DEPOT", "12 HARBOUR ROAD", "PORT TOWN 4410", "OPEN MONDAY", "CLOSED SUNDAY", "PHONE 5550199")
COLUMN_RIGHT = ("INVOICE 88213", "DATE 2024 03 14", "AMOUNT 415.20", "PAID IN FULL")
SPACED_LINES = ("TICKET 5590", "SECTION 01 CLAUSE 1037", "GATE 7 SEAT 22", "ORDER NUMBER 3344")
BANNER_LINE = "GRAND OPENING SALE 25 PERCENT OFF EVERY ITEM UNTIL 31 DECEMBER"
FORM_LEFT = (("BILL TO", ""), ("Name:", "ANNA BERG"), ("Street:", "12 HARBOUR ROAD"), ("Town:", "PORT TOWN 4410"),
             ("Phone:", "555 0199"))
FORM_RIGHT = (("SHIP TO", ""), ("Name:", "OLE HANSEN"), ("Street:", "4 MILL LANE"), ("Town:", "RIVERDALE 2210"),
              ("Phone:", "555 0342"))
LABEL_MAIN = ("CUSTOM GIFT BOXES AND BAGS", "PRINTED TO ORDER IN ANY SIZE", "FREE DESIGN ON EVERY ORDER")
LABEL_SIDE = ("ODM OEM", "(PACKAGING)")


def _png(img: Image.Image, **params) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG", **params)
    return buf.getvalue()


def _draw_lines(mode: str, size: tuple[int, int], ground, ink, lines, font_size: int = 40) -> Image.Image:
    img = Image.new(mode, size, ground)
    d = ImageDraw.Draw(img)
    for i, t in enumerate(lines):
        d.text((40, 30 + i * 80), t, fill=ink, font=font(font_size))
    return img


def png16(pixels: np.ndarray, color_type: int) -> bytes:
    """A 16-bit PNG (Pillow writes none with alpha): ``pixels`` ``uint16``, shape
    ``(h, w, channels)``; ``color_type`` 6 (RGBA) or 4 (grey + alpha), PNG spec 11.2.2."""
    h, w = pixels.shape[:2]
    raw = b"".join(b"\x00" + pixels[y].astype(">u2").tobytes() for y in range(h))

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def alpha_pages() -> list[Page]:
    """White text on a fully transparent background, in every way PNG can say "transparent".

    The transparent pixels' own colour differs per page: black (RGBA, LA, palette: a plain
    ``convert("RGB")`` then shows white on black) or white (the 16-bit pages: white on white,
    nothing to read unless alpha is honoured).
    """
    size = (700, 200)
    rgba = _draw_lines("RGBA", size, (0, 0, 0, 0), (255, 255, 255, 255), ALPHA_LINES)
    la = _draw_lines("LA", size, (0, 0), (255, 255), ALPHA_LINES)
    pal = _draw_lines("P", size, 0, 1, ALPHA_LINES)
    pal.putpalette([0, 0, 0, 255, 255, 255] + [0, 0, 0] * 254)
    ink = np.asarray(_draw_lines("L", size, 0, 255, ALPHA_LINES), dtype=np.uint16) * 257
    rgba16 = np.empty((size[1], size[0], 4), dtype=np.uint16)
    rgba16[..., :3] = 65535
    rgba16[..., 3] = ink
    la16 = np.stack([np.full_like(ink, 65535), ink], axis=-1)
    grey16 = Image.fromarray(ink.astype(np.uint16))  # I;16 with a tRNS key: 0 is transparent
    return [
        Page("white_on_transparent_rgba.png", "alpha", _png(rgba), ALPHA_LINES),
        Page("white_on_transparent_la.png", "alpha", _png(la), ALPHA_LINES),
        Page("white_on_transparent_palette.png", "alpha", _png(pal, transparency=0), ALPHA_LINES),
        Page("white_on_transparent_rgba16.png", "alpha", png16(rgba16, 6), ALPHA_LINES),
        Page("white_on_transparent_la16.png", "alpha", png16(la16, 4), ALPHA_LINES),
        Page("white_on_transparent_grey16_key.png", "alpha", _png(grey16, transparency=0), ALPHA_LINES),
    ]


def column_page() -> Page:
    """A two-column form: an address block on the left (6 lines, 60 px apart) and an invoice
    block on the right (4 lines, 90 px apart), 240 px of gutter between them, so the two
    blocks' lines do not line up. Read: the left column, then the right one."""
    f = font(32)
    left_w = max(int(f.getlength(t)) for t in COLUMN_LEFT)
    x_right = 40 + left_w + 240
    w = x_right + max(int(f.getlength(t)) for t in COLUMN_RIGHT) + 40
    img = Image.new("RGB", (w, 60 + 60 * len(COLUMN_LEFT)), "white")
    d = ImageDraw.Draw(img)
    for i, t in enumerate(COLUMN_LEFT):
        d.text((40, 30 + 60 * i), t, fill="black", font=f)
    for i, t in enumerate(COLUMN_RIGHT):
        d.text((x_right, 30 + 90 * i), t, fill="black", font=f)
    return Page("two_column_form.png", "columns", _png(img), COLUMN_LEFT + COLUMN_RIGHT)


def spaced_page() -> Page:
    """Lines of short words and numbers, one space apart: PP-OCR's recogniser reads several of
    them as one word ("TICKET5590") unless the spaces are put back."""
    img = _draw_lines("RGB", (800, 60 + 80 * len(SPACED_LINES)), "white", "black", SPACED_LINES)
    return Page("spaced_words.png", "spacing", _png(img), SPACED_LINES)


def banner_page() -> Page:
    """A 6000x160 banner: one line of 135 px type (capitals about 100 px tall) across 5,600 of
    its 6,000 pixels."""
    img = Image.new("RGB", (6000, 160), "white")
    ImageDraw.Draw(img).text((200, 0), BANNER_LINE, fill="black", font=font(135))
    return Page("banner_6000x160.png", "banner", _png(img), (BANNER_LINE,))


def key_value_form_page() -> Page:
    """Two groups of key/value fields side by side ("BILL TO" and "SHIP TO"), their rows level
    with each other: in each group a key, then its value 75 px after the longest key; between the
    groups 240 px (about 7 text heights, twice the widest gap between a key and its value). Read:
    the left group, then the right one (read row by row across, each line would hold two groups'
    fields)."""
    f = font(30)
    key_w = max(int(f.getlength(k)) for k, _ in FORM_LEFT + FORM_RIGHT)
    group_w = key_w + 75 + max(int(f.getlength(v)) for _, v in FORM_LEFT + FORM_RIGHT)
    x_right = 40 + group_w + 240
    img = Image.new("RGB", (x_right + group_w + 40, 80 + 56 * len(FORM_LEFT)), "white")
    d = ImageDraw.Draw(img)
    for x0, group in ((40, FORM_LEFT), (x_right, FORM_RIGHT)):
        for i, (key, value) in enumerate(group):
            d.text((x0, 30 + 56 * i), key, fill="black", font=f)
            if value:
                d.text((x0 + key_w + 75, 30 + 56 * i), value, fill="black", font=f)
    lines = tuple(f"{k} {v}".strip() for k, v in FORM_LEFT) + tuple(f"{k} {v}".strip() for k, v in FORM_RIGHT)
    return Page("key_value_form.png", "regions", _png(img), lines)


def side_label_page() -> Page:
    """A product sheet: three lines of 40 px type on a cream ground, and beside the first two, 7
    text heights to their right, a short label of two lines of 24 px type on a coloured box
    (``ODM OEM``, ``(PACKAGING)``: the ``（成品包材）`` of a real one), each label line level with
    a line of the text. Read: the text, then the label (a label line joined to the text line
    beside it would split the text)."""
    big, small = font(40), font(24)
    main_w = max(int(big.getlength(t)) for t in LABEL_MAIN)
    x_label = 40 + main_w + 280
    label_w = max(int(small.getlength(t)) for t in LABEL_SIDE)
    img = Image.new("RGB", (x_label + label_w + 60, 60 + 70 * len(LABEL_MAIN)), (250, 244, 228))
    d = ImageDraw.Draw(img)
    d.rectangle([x_label - 14, 34, x_label + label_w + 14, 34 + 70 * len(LABEL_SIDE) + 6], fill=(255, 214, 150))
    for i, t in enumerate(LABEL_MAIN):
        d.text((40, 30 + 70 * i), t, fill=(40, 30, 20), font=big)
    for i, t in enumerate(LABEL_SIDE):
        d.text((x_label, 42 + 70 * i), t, fill=(120, 20, 20), font=small)
    return Page("side_label.png", "regions", _png(img), LABEL_MAIN + LABEL_SIDE)


def all_pages() -> list[Page]:
    """Every generated page, kinds in the bench table's order."""
    return [*alpha_pages(), column_page(), spaced_page(), banner_page(), key_value_form_page(), side_label_page()]


ORDER_TITLE = "FRUIT ORDER"
ORDER_PARAGRAPH = [
    "The order below was placed on the third of May by the shop on the corner of",
    "the market square and delivered to it two days later by the usual carrier, who",
    "was paid in cash on delivery as agreed with the owner of the shop in April.",
    "The prices are per box and include the tax of the region.",
]
ORDER_TABLE = [["ITEM", "QTY", "PRICE"], ["APPLE", "2", "3.50"], ["PEAR", "10", "12.00"]]


def order_page() -> bytes:
    """A 900x700 PNG with a heading (:data:`ORDER_TITLE`), a paragraph of four lines
    (:data:`ORDER_PARAGRAPH`) and a ruled 3x3 table (:data:`ORDER_TABLE`): the layout and table
    models of the CPU engine's ``doc_parse``/``table`` find a title, a text and a table region on
    it. Not in :func:`all_pages` (the engine CER bench)."""
    img = Image.new("RGB", (900, 700), "white")
    d = ImageDraw.Draw(img)
    d.text((250, 40), ORDER_TITLE, fill="black", font=font(44))
    for i, t in enumerate(ORDER_PARAGRAPH):
        d.text((60, 130 + i * 30), t, fill="black", font=font(18))
    x0, y0, cw, rh = 60, 280, 260, 70
    for r in range(len(ORDER_TABLE) + 1):
        d.line([(x0, y0 + r * rh), (x0 + 3 * cw, y0 + r * rh)], fill="black", width=2)
    for c in range(4):
        d.line([(x0 + c * cw, y0), (x0 + c * cw, y0 + 3 * rh)], fill="black", width=2)
    for r, row in enumerate(ORDER_TABLE):
        for c, t in enumerate(row):
            d.text((x0 + c * cw + 20, y0 + r * rh + 18), t, fill="black", font=font(28))
    return _png(img)
