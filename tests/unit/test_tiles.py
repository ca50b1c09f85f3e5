"""Tiling long pages and mapping boxes back to page pixels."""

import numpy as np

from services.infer.textlines import Segment
from services.infer.tiles import make_tiles, map_back


def test_regular_page_is_one_tile():
    [t] = make_tiles(np.zeros((800, 600, 3), np.uint8), max_aspect=3, max_side=2000)
    assert t.scale == 1.0 and (t.x0, t.y0) == (0, 0) and t.image.shape == (800, 600, 3)


def test_big_page_is_downscaled_and_boxes_scale_back():
    [t] = make_tiles(np.zeros((4000, 3000, 3), np.uint8), max_aspect=3, max_side=2000)
    assert t.scale == 0.5 and t.image.shape[:2] == (2000, 1500)
    [s] = map_back(t, [Segment([[10, 20], [110, 20], [110, 40], [10, 40]], "x", 0.9)], 3000, 4000)
    assert s.box == [[20, 40], [220, 40], [220, 80], [20, 80]]


def test_an_engine_that_shrinks_pages_itself_gets_them_whole_and_long_ones_still_sliced():
    """downscale=False (the CPU engine: RapidOCR shrinks to max_side itself, to a multiple of 32,
    so a page shrunk here first would be resampled twice)."""
    [t] = make_tiles(np.zeros((4000, 3000, 3), np.uint8), max_aspect=3, max_side=2000, downscale=False)
    assert t.scale == 1.0 and t.image.shape[:2] == (4000, 3000)
    tiles = make_tiles(np.zeros((9000, 600, 3), np.uint8), max_aspect=3, max_side=2000, downscale=False)
    assert len(tiles) > 4 and all(t.scale == 1.0 and t.image.shape[0] <= 2000 for t in tiles)


def test_long_receipt_is_sliced_and_each_line_kept_once():
    h, w = 12000, 600
    tiles = make_tiles(np.zeros((h, w, 3), np.uint8), max_aspect=3, max_side=2000)
    assert len(tiles) > 5 and all(t.scale == 1.0 for t in tiles)
    assert tiles[0].y0 == 0 and tiles[-1].y0 + tiles[-1].image.shape[0] == h
    # a line every 150 px: each must be reported by exactly one tile
    found = []
    for t in tiles:
        segs = []
        for y in range(20, h, 150):
            top = y - t.y0
            if 0 <= top and top + 34 <= t.image.shape[0]:
                segs.append(Segment([[10, top], [300, top], [300, top + 34], [10, top + 34]], str(y), 0.9))
        found += [s.text for s in map_back(t, segs, w, h)]
    assert sorted(found, key=int) == [str(y) for y in range(20, h, 150)]


def test_wide_page_is_sliced_left_to_right():
    tiles = make_tiles(np.zeros((100, 5000, 3), np.uint8), max_aspect=3, max_side=2000)
    assert len(tiles) > 1 and all(t.y0 == 0 for t in tiles) and tiles[1].x0 > 0


def test_a_single_long_text_line_that_fits_is_not_cut():
    [t] = make_tiles(np.zeros((25, 323, 3), np.uint8), max_aspect=3, max_side=2000)
    assert t.image.shape == (25, 323, 3) and t.scale == 1.0


def test_boxes_map_back_with_each_axis_own_scale():
    # 1000 x 301 at max_side 500: scale 0.5, width 500 but height round(150.5) = 150, so
    # y scale is 150/301, not 0.5 (one scale for both axes put the page bottom at 300)
    [t] = make_tiles(np.zeros((301, 1000, 3), np.uint8), max_aspect=10, max_side=500)
    assert t.image.shape[:2] == (150, 500) and (t.scale_x, t.scale_y) == (0.5, 150 / 301)
    [s] = map_back(t, [Segment([[0, 75], [500, 75], [500, 150], [0, 150]], "x", 0.9)], 1000, 301)
    assert s.box == [[0, 150.5], [1000, 150.5], [1000, 301], [0, 301]]


def banner(words: list[tuple[int, int]], w: int = 6000, h: int = 160) -> np.ndarray:
    """A white page with a black block (a "word") over each ``(x0, x1)``, rows 30-130."""
    page = np.full((h, w, 3), 255, np.uint8)
    for a, b in words:
        page[30:130, a:b] = 0
    return page


def test_a_wide_page_is_cut_between_words_and_each_slice_padded_to_full_length():
    # words 300-670 px long, 40 px apart: a cut at a fixed place would go through one
    words, x = [], 200
    for i in range(11):
        n = 300 + 37 * i
        words.append((x, x + n))
        x += n + 40
    assert x < 6000
    page = banner(words)
    tiles = make_tiles(page, max_aspect=3, max_side=2000)
    assert len(tiles) >= 3 and all(t.y0 == 0 and t.scale == 1.0 for t in tiles)
    assert all(t.image.shape == (160, 2000, 3) for t in tiles)  # one shape: one engine scale
    for t, nxt in zip(tiles, tiles[1:]):
        cut = t.core[1]
        assert cut == nxt.core[0]
        assert not any(a <= cut < b for a, b in words), cut  # in a gap, not through a word
        # the slice stops within the gap: no piece of the word after the cut gets in
        ink = np.flatnonzero((t.image[30:130, :, 0] == 0).any(axis=0)) + t.x0
        assert not any(cut < a <= ink.max() for a, _ in words), (cut, ink.max())
    # every word is owned by exactly one slice (its centre in the slice's core)
    for a, b in words:
        assert sum(t.core[0] <= (a + b) / 2 < t.core[1] for t in tiles) == 1


def test_a_tall_page_is_cut_in_a_blank_row_and_keeps_the_full_overlap():
    page = np.full((6000, 600, 3), 255, np.uint8)
    lines = [(y, y + 34) for y in range(20, 6000 - 40, 52)]
    for a, b in lines:
        page[a:b, 40:500] = 0
    tiles = make_tiles(page, max_aspect=3, max_side=2000)
    assert len(tiles) >= 3 and all(t.x0 == 0 and t.image.shape[0] <= 2000 for t in tiles)
    for t, nxt in zip(tiles, tiles[1:]):
        cut = t.core[1]
        assert not any(a <= cut < b for a, b in lines), cut
        assert t.y0 + t.image.shape[0] - nxt.y0 >= 2 * 150 - 2  # the next row is another line: full overlap


def test_a_page_with_no_blank_line_is_cut_at_full_length_with_the_fixed_overlap():
    rng = np.random.default_rng(7)
    page = rng.integers(0, 256, (100, 5000, 3), dtype=np.uint8)  # noise: no column is blank
    tiles = make_tiles(page, max_aspect=3, max_side=2000)
    assert [t.x0 for t in tiles] == [0, 1700, 3400]  # each reaching 150 px past its cut
    assert [t.core for t in tiles] == [(0.0, 1850.0), (1850.0, 3550.0), (3550.0, 5000.0)]
    assert np.array_equal(tiles[2].image[:, :1600], page[:, 3400:])  # the last, padded to full length
