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
        scale: Engine pixels per page pixel (<= 1).
        core: ``(start, end)`` along the long axis of the part of the page this tile owns.
        vertical: True when the page was sliced top to bottom.
    """

    image: np.ndarray
    x0: int
    y0: int
    scale: float
    core: tuple[float, float]
    vertical: bool


def make_tiles(page: np.ndarray, max_aspect: float, max_side: int, overlap_frac: float = 0.15) -> list[Tile]:
    """Cut ``page`` (H x W x 3) into engine-ready tiles. Returns at least one tile."""
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
        if scale < 1.0:
            resized = Image.fromarray(crop).resize((max(1, round(cw * scale)), max(1, round(ch * scale))), Image.BILINEAR)
            crop = np.asarray(resized)
        tiles.append(Tile(np.ascontiguousarray(crop), 0 if vertical else a, a if vertical else 0, scale, (core_a, core_b), vertical))
    return tiles


def map_back(tile: Tile, segments: list[Segment], page_w: int, page_h: int) -> list[Segment]:
    """Boxes from engine pixels of ``tile`` to page pixels, keeping only segments owned by the tile."""
    out = []
    for seg in segments:
        box = [
            [min(page_w, max(0.0, x / tile.scale + tile.x0)), min(page_h, max(0.0, y / tile.scale + tile.y0))]
            for x, y in seg.box
        ]
        centre = sum(p[1] if tile.vertical else p[0] for p in box) / 4
        if tile.core[0] <= centre < tile.core[1] or (centre == tile.core[1] and tile.core[1] >= (page_h if tile.vertical else page_w)):
            out.append(Segment(box=[[round(x, 1), round(y, 1)] for x, y in box], text=seg.text, confidence=seg.confidence))
    return out
