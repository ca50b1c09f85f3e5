"""Near-duplicate images: a perceptual hash finds candidates, a block-wise comparison verifies them.

A perceptual hash (pHash) is the same for a page and its JPEG re-encode or rescale, but it is
also the same, or nearly so, for two invoices printed from one template that differ in a few
digits. A hash match is therefore only a *candidate*; :func:`verify` accepts it only when the
two pages are the same picture everywhere, down to one changed digit:

1. both pages are upright 8-bit RGB; their aspect ratios must agree within
   ``max_aspect_diff`` (or 1 px of rounding) and their sizes within ``max_scale_ratio``;
2. both are converted to grey and resampled (Lanczos) to the size of the *smaller* one (never
   upsampled, so the comparison sees what the smaller image holds), capped at
   ``max_compare_pixels``;
3. both get a light Gaussian blur (``blur_radius`` px), which absorbs JPEG ringing and the
   sub-pixel shifts of resampling but keeps a character's strokes;
4. the grey difference is pooled over every ``block_px`` x ``block_px`` window, at a stride of
   half a window (so a character straddling a window border is still seen whole), with the L4
   power mean ``(mean |a - b|**4) ** (1/4)``, and the pair matches only if *every* window is
   within ``max_block_diff`` grey levels.

A changed digit adds or removes a stroke: a few pixels that differ strongly, inside one
window. A re-encode or resampling leaves weak differences along every edge. A global score
(mean difference, SSIM, hash distance) averages the stroke away; a per-window plain mean still
does for small type; the L4 mean weighs strong differences over weak ones (Minkowski pooling,
as in Z. Wang and X. Shang, "Spatial pooling strategies for perceptual image quality
assessment", ICIP 2006). On 428 pairs the L4 mean over 8 px windows separated
re-encodes/rescales (at most 14.9) from one-digit edits in 12-16 px type (at least 20.0),
where a plain mean over 12 px windows overlapped (10.6 vs 6.7). On the 1,812 pairs of
``bench/near_dup_bench.py`` the closest were 15.4 (a rescale) and 15.9 (a look-alike digit in
12-16 px type, rescaled 0.9), so the default threshold is 12: a 1.3x margin below the closest
different document, paid for with about 8 % of the rescaled copies (JPEG re-encodes all pass).
The thresholds are measured, not derived.
"""

from __future__ import annotations

from dataclasses import dataclass

import imagehash
import numpy as np
from PIL import Image, ImageFilter

from schemas.reading import Line

HASH_BITS = 64
POOL_POWER = 4
"""Exponent of the power mean that pools a window's grey differences (see the module docstring)."""


@dataclass(frozen=True)
class VerifyParams:
    """Thresholds of :func:`verify` (defaults measured by ``bench/near_dup_bench.py``).

    Attributes:
        block_px: Side of a comparison window, in pixels of the compared (smaller) page.
        max_block_diff: Largest L4 mean of the grey difference (0-255) any window may have.
        blur_radius: Gaussian blur radius (px) applied to both pages before differencing.
        max_aspect_diff: Largest relative error of the shorter side predicted from the longer
            one by the other page's aspect ratio (at least 1 px is always allowed, for rounding).
        max_scale_ratio: Largest ratio of the two pages' widths (the larger over the smaller).
        min_compare_side: Pages whose longer side is under this (px) at the compared size are
            never matched: too few pixels to tell one digit from another.
        max_compare_pixels: The compared pages are downscaled to at most this many pixels.
    """

    block_px: int = 8
    max_block_diff: float = 12.0
    blur_radius: float = 1.0
    max_aspect_diff: float = 0.01
    max_scale_ratio: float = 1.5
    min_compare_side: int = 256
    max_compare_pixels: int = 6_000_000


@dataclass(frozen=True)
class Verdict:
    """Outcome of :func:`verify`.

    Attributes:
        match: True only if every check passed.
        reason: ``"ok"``, ``"aspect"``, ``"scale"``, ``"small"`` or ``"blocks"``.
        worst_block: Largest window L4 mean difference in grey levels (0-255); NaN when the pages
            were not compared pixel by pixel.
        compared: ``(width, height)`` in pixels at which the pages were compared, or None.
    """

    match: bool
    reason: str
    worst_block: float = float("nan")
    compared: tuple[int, int] | None = None


def phash64(page: np.ndarray) -> int:
    """The 64-bit DCT perceptual hash of one page, as an unsigned integer.

    Uses ``imagehash.phash`` (grey, 32 x 32, 2-D DCT, top-left 8 x 8 coefficients against
    their median), after N. Krawetz, "Looks Like It" (hackerfactor.com, 2011).

    Args:
        page: ``uint8`` array of shape ``(height, width, 3)`` (RGB) or ``(height, width)`` (grey).

    Returns:
        An int in ``[0, 2**64)``; bit ``i`` is hash bit ``i`` in row-major order.
    """
    h = imagehash.phash(Image.fromarray(page))
    return int(str(h), 16)


def hamming(a: int, b: int) -> int:
    """Number of differing bits of two hashes."""
    return (a ^ b).bit_count()


def bands(h: int, n_bands: int = 8) -> list[int]:
    """Split a 64-bit hash into ``n_bands`` equal slices (LSH bands), most significant first.

    Two hashes within Hamming distance ``n_bands - 1`` share at least one band exactly
    (pigeonhole), so looking up every band finds every such candidate.

    Raises:
        ValueError: if 64 is not a multiple of ``n_bands``.
    """
    if HASH_BITS % n_bands:
        raise ValueError(f"{HASH_BITS} bits do not split into {n_bands} bands")
    width = HASH_BITS // n_bands
    mask = (1 << width) - 1
    return [(h >> (HASH_BITS - width * (i + 1))) & mask for i in range(n_bands)]


def _grey(page: np.ndarray) -> Image.Image:
    img = Image.fromarray(page)
    return img if img.mode == "L" else img.convert("L")


def _window_means(diff: np.ndarray, block: int) -> np.ndarray:
    """Mean of ``diff`` over every ``block`` x ``block`` window at stride ``block // 2``
    (windows at the right and bottom edges are aligned to the edge)."""
    h, w = diff.shape
    block = max(1, min(block, h, w))
    integral = np.zeros((h + 1, w + 1), dtype=np.float64)
    integral[1:, 1:] = diff.cumsum(0).cumsum(1)
    step = max(1, block // 2)
    ys = np.unique(np.r_[np.arange(0, h - block + 1, step), h - block])
    xs = np.unique(np.r_[np.arange(0, w - block + 1, step), w - block])
    y0, x0 = ys[:, None], xs[None, :]
    sums = integral[y0 + block, x0 + block] - integral[y0, x0 + block] - integral[y0 + block, x0] + integral[y0, x0]
    return sums / (block * block)


def _same_aspect(wa: int, ha: int, wb: int, hb: int, tol: float) -> bool:
    """True if ``b``'s shorter side is what ``a``'s aspect ratio predicts from ``b``'s longer
    side, within ``tol`` (relative) or 1 px (rounding when the copy was resized)."""
    if (wa >= ha) != (wb >= hb) and wa != ha and wb != hb:
        return False
    if wb >= hb:
        return abs(hb - ha * wb / wa) <= max(1.0, tol * hb)
    return abs(wb - wa * hb / ha) <= max(1.0, tol * wb)


def verify(a: np.ndarray, b: np.ndarray, params: VerifyParams = VerifyParams()) -> Verdict:
    """Decide whether page ``b`` is the same picture as page ``a`` (re-encoded or rescaled).

    See the module docstring for the method. Symmetric up to resampling.

    Args:
        a: ``uint8`` array ``(height, width, 3)`` or ``(height, width)``: the candidate page.
        b: the same for the new page.
        params: Thresholds.

    Returns:
        The :class:`Verdict`; ``match`` is True only if every window is within threshold.
    """
    ha, wa = a.shape[:2]
    hb, wb = b.shape[:2]
    if not _same_aspect(wa, ha, wb, hb, params.max_aspect_diff):
        return Verdict(False, "aspect")
    if max(wa, wb) / min(wa, wb) > params.max_scale_ratio:
        return Verdict(False, "scale")
    small = a if wa * ha <= wb * hb else b
    h, w = small.shape[:2]
    if w * h > params.max_compare_pixels:
        f = (params.max_compare_pixels / (w * h)) ** 0.5
        w, h = max(1, int(w * f)), max(1, int(h * f))
    if max(w, h) < params.min_compare_side:
        return Verdict(False, "small", compared=(w, h))
    blur = ImageFilter.GaussianBlur(params.blur_radius)

    def prepared(page: np.ndarray) -> np.ndarray:
        img = _grey(page)
        if img.size != (w, h):
            img = img.resize((w, h), Image.Resampling.LANCZOS)
        return np.asarray(img.filter(blur), dtype=np.float32)

    diff = np.abs(prepared(a) - prepared(b))
    worst = float(_window_means(diff ** POOL_POWER, params.block_px).max()) ** (1 / POOL_POWER)
    return Verdict(worst <= params.max_block_diff, "ok" if worst <= params.max_block_diff else "blocks", worst, (w, h))


def scale_lines(lines: list[Line], src: tuple[int, int], dst: tuple[int, int]) -> list[Line]:
    """Map lines from one page size to another (boxes scaled per axis, text unchanged).

    Args:
        lines: Lines whose boxes are in pixels of a page of size ``src``.
        src: ``(width, height)`` of the page the boxes refer to, in pixels.
        dst: ``(width, height)`` of the page to map them onto, in pixels.

    Returns:
        New lines; each corner ``(x, y)`` of a line and of its segments becomes
        ``(x * dst_w / src_w, y * dst_h / src_h)``, rounded to 0.01 px.
    """
    sx, sy = dst[0] / src[0], dst[1] / src[1]

    def scaled(box: list[list[float]]) -> list[list[float]]:
        return [[round(x * sx, 2), round(y * sy, 2)] for x, y in box]

    return [
        line.model_copy(update={
            "box": scaled(line.box),
            "segments": None if line.segments is None else
            [seg.model_copy(update={"box": scaled(seg.box)}) for seg in line.segments],
        })
        for line in lines
    ]
