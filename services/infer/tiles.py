"""Preparing pages for the engine and mapping boxes back.

* Long pages (longer side > the engine's ``max_side`` and longer/shorter > ``max_aspect``) are
  sliced along the long side into overlapping tiles ``max_side`` long, so a 1:20 receipt is
  read at full resolution instead of being shrunk until its text is a few pixels tall. Pages
  that already fit (a single 25x323 text line, say) are left whole.
* Tiles larger than the engine's ``max_side`` are downscaled for the engine.
* Boxes are mapped back to the original (upright) page: scaled up, shifted by the tile offset;
  a line seen in two overlapping tiles is kept only from the tile whose core holds its centre.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from services.common.textlines import Segment


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


def make_tiles(page: np.ndarray, max_aspect: float, max_side: int, overlap_frac: float = 0.15) -> list[Tile]:
    """Cut a page into engine-ready tiles (sliced if long, downscaled if large).

    A page is sliced only when its long side is above ``max_side`` *and* long side / short
    side is above ``max_aspect``; a large page of ordinary shape stays one tile, downscaled
    so its long side is ``max_side``.

    Args:
        page: RGB ``uint8`` array, shape ``(height, width, 3)``, pixels of the upright page.
        max_aspect: Long side / short side above which a page longer than ``max_side`` is
            sliced (``tile_max_aspect``).
        max_side: Longest side in pixels handed to the engine (the engine's ``max_side``).
        overlap_frac: Overlap of neighbouring slices as a fraction of the slice length
            (slices are ``max(max_side, short side)`` pixels long; at least 32 pixels overlap),
            so a text line cut by one slice's edge is whole in the next.

    Returns:
        At least one :class:`Tile`, in page order (top to bottom or left to right); each tile
        image has its longest side at most ``max_side`` pixels.

    Raises:
        Nothing of its own: ``page`` must be a non-empty ``(height, width, 3)`` array.
    """
    h, w = page.shape[:2]
    vertical = h >= w
    long, short = (h, w) if vertical else (w, h)
    if long <= max_side or long <= max_aspect * short:
        spans = [(0, long)]
    else:
        size = max(max_side, short)
        overlap = max(32, int(size * overlap_frac))
        stride = size - overlap
        starts = list(range(0, max(1, long - size) + 1, stride))
        if starts[-1] + size < long:
            starts.append(long - size)
        spans = [(s, s + size) for s in starts]
    tiles = []
    for i, (a, b) in enumerate(spans):
        core_a = 0.0 if i == 0 else (a + spans[i - 1][1]) / 2
        core_b = float(long) if i == len(spans) - 1 else (spans[i + 1][0] + b) / 2
        crop = page[a:b] if vertical else page[:, a:b]
        ch, cw = crop.shape[:2]
        scale = min(1.0, max_side / max(ch, cw))
        sx = sy = scale
        if scale < 1.0:
            nw, nh = max(1, round(cw * scale)), max(1, round(ch * scale))
            crop = np.asarray(Image.fromarray(crop).resize((nw, nh), Image.BILINEAR))
            sx, sy = nw / cw, nh / ch  # each side rounded on its own: the true scale per axis
        tiles.append(Tile(np.ascontiguousarray(crop), 0 if vertical else a, a if vertical else 0, scale,
                          (core_a, core_b), vertical, sx, sy))
    return tiles


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
