"""Preparing pages for the engine and mapping boxes back.

* Long pages (longer side > the engine's ``max_side`` and longer/shorter > ``max_aspect``),
  tall or wide, are sliced along the long side into overlapping tiles at most ``max_side``
  long, so a 1:20 receipt or a 6000x160 banner is read at full resolution instead of being
  shrunk until its text is a few pixels tall. Each cut is placed in the widest blank gap
  (rows or columns without ink) near where the tile would end, so a cut goes between two
  lines of a receipt or two words of a banner, not through a word; a tile then reaches past
  its cut only as far as the gap goes (for a wide page; a tall page's tiles overlap by the
  fixed amount, as the next line is another row). A page without such a gap is cut at the
  tile's length with the fixed overlap. Slices of a wide page shorter than the others are
  padded to full length with their own background colour. Pages that already fit (a single
  25x323 text line, say) are left whole.
* Tiles larger than the engine's ``max_side`` are downscaled for the engine, unless it shrinks
  them itself (``downscale=False``: the CPU engine, whose detector resizes every image anyway).
* Boxes are mapped back to the original (upright) page: scaled up, shifted by the tile offset;
  a line seen in two overlapping tiles is kept only from the tile whose core holds its centre.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from services.infer.textlines import Segment


@dataclass(frozen=True)
class Tile:
    """A piece of a page as handed to the engine.

    Attributes:
        image: RGB ``uint8`` array given to the engine (possibly downscaled).
        x0, y0: Offset of the tile in the page, pixels.
        scale: Engine pixels per page pixel (<= 1), as chosen: ``max_side / longest side``.
        core: ``(start, end)`` along the long axis of the part of the page this tile owns.
        vertical: True when the page was sliced top to bottom.
        scale_x, scale_y: Engine pixels per page pixel along each axis, as the resize really
            came out (each side is rounded to whole pixels on its own, so they differ slightly
            from ``scale`` and from each other); :func:`map_back` uses these. Default ``scale``.
    """

    image: np.ndarray
    x0: int
    y0: int
    scale: float
    core: tuple[float, float]
    vertical: bool
    scale_x: float | None = None
    scale_y: float | None = None

    def __post_init__(self) -> None:
        if self.scale_x is None:
            object.__setattr__(self, "scale_x", self.scale)
        if self.scale_y is None:
            object.__setattr__(self, "scale_y", self.scale)


INK_CONTRAST = 48
"""Grey levels (0-255) a pixel must differ from the median of its row or column to count as ink
when looking for a blank gap to cut in."""
INK_PIXELS = 0.002
"""Share of a row's or column's pixels that may be ink (specks, noise) while it still counts as
blank."""


def make_tiles(page: np.ndarray, max_aspect: float, max_side: int, overlap_frac: float = 0.15,
               downscale: bool = True) -> list[Tile]:
    """Cut a page into engine-ready tiles (sliced if long, downscaled if large).

    A page is sliced only when its long side is above ``max_side`` *and* long side / short
    side is above ``max_aspect``; a large page of ordinary shape stays one tile, downscaled
    so its long side is ``max_side``. Tall pages are sliced top to bottom, wide ones left to
    right, the same way (:func:`_cuts`).

    Args:
        page: RGB ``uint8`` array, shape ``(height, width, 3)``, pixels of the upright page.
        max_aspect: Long side / short side above which a page longer than ``max_side`` is
            sliced (``tile_max_aspect``).
        max_side: Longest side in pixels handed to the engine (the engine's ``max_side``).
        overlap_frac: Overlap of neighbouring slices as a fraction of the slice length
            (slices are at most ``max(max_side, short side)`` pixels long; at least 32 pixels
            overlap), so a text line cut by one slice's edge is whole in the next. Where a
            cut lies in a blank gap, the slices overlap only as far as the gap reaches.
        downscale: Shrink a tile longer than ``max_side`` to ``max_side``. False for an engine
            that shrinks large images itself (:attr:`~services.infer.engines.base.OcrEngine.shrinks_large_pages`):
            the tile goes at full resolution, so it is resampled once, the engine's way.

    Returns:
        At least one :class:`Tile`, in page order (top to bottom or left to right); with
        ``downscale``, each tile image has its longest side at most ``max_side`` pixels.

    Raises:
        Nothing of its own: ``page`` must be a non-empty ``(height, width, 3)`` array.
    """
    h, w = page.shape[:2]
    vertical = h >= w
    long, short = (h, w) if vertical else (w, h)
    if long <= max_side or long <= max_aspect * short:
        spans, cuts = [(0, long)], []
    else:
        size = max(max_side, short)
        overlap = max(32, int(size * overlap_frac))
        spans, cuts = _cuts(_blank_lines(page, vertical), size, overlap, tight=not vertical)
    tiles = []
    for i, (a, b) in enumerate(spans):
        core_a = 0.0 if i == 0 else float(cuts[i - 1])
        core_b = float(long) if i == len(spans) - 1 else float(cuts[i])
        crop = page[a:b] if vertical else page[:, a:b]
        if not vertical and len(spans) > 1 and b - a < size:
            crop = _pad_right(crop, size)
        ch, cw = crop.shape[:2]
        scale = min(1.0, max_side / max(ch, cw)) if downscale else 1.0
        sx = sy = scale
        if scale < 1.0:
            nw, nh = max(1, round(cw * scale)), max(1, round(ch * scale))
            crop = np.asarray(Image.fromarray(crop).resize((nw, nh), Image.BILINEAR))
            sx, sy = nw / cw, nh / ch  # each side rounded on its own: the true scale per axis
        tiles.append(Tile(np.ascontiguousarray(crop), 0 if vertical else a, a if vertical else 0, scale,
                          (core_a, core_b), vertical, sx, sy))
    return tiles


def _pad_right(crop: np.ndarray, size: int) -> np.ndarray:
    """``crop`` widened to ``size`` columns with the colour of its last column (its median, per
    channel): every slice of a wide page reaches the engine at one shape, so one scale. (RapidOCR
    scales an image up until its short side is 736 px, unless it is over 8 times as wide as
    tall, when it pads it instead: a 1100x160 slice of a banner went in at 4.6 times, its
    100 px letters read one by one, while the 2000x160 ones went in at 1.5 times.)"""
    h, w = crop.shape[:2]
    out = np.empty((h, size, 3), dtype=crop.dtype)
    out[:, :w] = crop
    out[:, w:] = np.median(crop[:, -1], axis=0).astype(crop.dtype)
    return out


def _blank_lines(page: np.ndarray, vertical: bool) -> np.ndarray:
    """One bool per row (``vertical``) or column of ``page``: True where it holds no ink (at most
    :data:`INK_PIXELS` of its pixels differ from its own median by :data:`INK_CONTRAST` or
    more; a line's own median, so a shadow or a coloured ground is not ink)."""
    grey = (page[..., 0] // 4 + page[..., 1] // 2 + page[..., 2] // 4).astype(np.int16)  # ~BT.601 luma
    lines = grey if vertical else grey.T
    med = np.median(lines, axis=1, keepdims=True).astype(np.int16)
    ink = (np.abs(lines - med) >= INK_CONTRAST).sum(axis=1)
    return ink <= INK_PIXELS * lines.shape[1]


def _cuts(blank: np.ndarray, size: int, overlap: int, tight: bool) -> tuple[list[tuple[int, int]], list[int]]:
    """Slices ``[(start, end), ...]`` of a page ``len(blank)`` long and the cuts between them.

    Slice ``k`` owns ``[cut[k-1], cut[k])`` and reaches past each of its cuts by up to
    ``overlap / 2``, so it is at most ``size`` long. Each cut is the middle of the widest run of
    blank lines in the last half (``size / 2``) of the room the slice has (the later of equal
    runs; a run is measured within that window); with no blank line there, the cut is as far as
    the slice can reach. With ``tight``, a slice reaches
    past a blank cut only within its run: across a cut between two words of one text line the
    detector would join a piece of the next word to the last word before the cut.
    """
    long = len(blank)
    reach = max(1, min(overlap // 2, size // 4))
    cuts: list[int] = []
    spans: list[tuple[int, int]] = []
    start = prev = 0  # where the current slice starts; where its own part starts
    while long - start > size:
        hi = start + size - reach
        lo = max(prev + 1, hi - size // 2)
        run = _widest_run(blank, lo, hi)
        if run is None:
            cut, end, nxt = hi, hi + reach, hi - reach
        else:
            cut = run[2]
            end, nxt = cut + reach, cut - reach
            if tight:
                end, nxt = min(end, run[1]), max(nxt, run[0])
        spans.append((start, end))
        cuts.append(cut)
        start, prev = nxt, cut
    spans.append((start, long))
    return spans, cuts


def _widest_run(blank: np.ndarray, lo: int, hi: int) -> tuple[int, int, int] | None:
    """The widest run of blank lines within ``[lo, hi)`` (the later of equal ones) as
    ``(r0, r1, cut)``: the run's whole extent ``[r0, r1)``, beyond the window too, and the middle
    of its part within the window; None if the window has no blank line."""
    n = len(blank)
    a, b = max(0, lo), min(n, hi)
    if a >= b:
        return None
    window = blank[a:b]
    if not window.any():
        return None
    edges = np.flatnonzero(np.diff(np.concatenate(([0], window.astype(np.int8), [0]))))
    starts, stops = edges[0::2], edges[1::2]
    k = len(starts) - 1 - int(np.argmax((stops - starts)[::-1]))  # the widest, the later of equals
    r0, r1 = a + int(starts[k]), a + int(stops[k])
    cut = (r0 + r1) // 2
    while r0 > 0 and blank[r0 - 1]:
        r0 -= 1
    while r1 < n and blank[r1]:
        r1 += 1
    return r0, r1, cut


def map_back(tile: Tile, segments: list[Segment], page_w: int, page_h: int) -> list[Segment]:
    """Map boxes from engine pixels of ``tile`` to page pixels, keeping only segments the tile owns.

    x is divided by the tile's x scale and y by its y scale (the resize rounded each side on its
    own), shifted by the tile's offset and clipped to the page. A segment is kept when the
    centre of its mapped box along the slicing axis lies in the tile's ``core`` (the last tile
    also owns the page's far edge), so a line seen in two overlapping tiles is reported once.

    Args:
        tile: The tile the engine read (from :func:`make_tiles`).
        segments: The engine's segments for ``tile.image``; boxes are 4 ``[x, y]`` points in
            pixels of ``tile.image``.
        page_w: Width of the whole page in pixels.
        page_h: Height of the whole page in pixels.

    Returns:
        The kept segments with boxes in page pixels (rounded to 0.1 pixel), in input order.

    Raises:
        Nothing of its own; a box that is not 4 points gives a wrong ownership test, so
        engines must return quadrilaterals.
    """
    out = []
    for seg in segments:
        box = [
            [min(page_w, max(0.0, x / tile.scale_x + tile.x0)), min(page_h, max(0.0, y / tile.scale_y + tile.y0))]
            for x, y in seg.box
        ]
        centre = sum(p[1] if tile.vertical else p[0] for p in box) / 4
        if tile.core[0] <= centre < tile.core[1] or (centre == tile.core[1] and tile.core[1] >= (page_h if tile.vertical else page_w)):
            out.append(Segment(box=[[round(x, 1), round(y, 1)] for x, y in box], text=seg.text, confidence=seg.confidence))
    return out
