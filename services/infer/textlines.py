"""Result assembly: engine segments -> text lines in reading order, and the CER metric.

How lines are assembled (the whole story, with the measurements behind every threshold, is
``docs/lines.md``):

1. **Rows.** Segments whose vertical extents overlap by at least half the smaller height, and
   that do not overlap each other horizontally, share a row.
2. **Columns.** A run of consecutive rows that all leave the same vertical strip free (a
   *gutter*, at least :data:`COLUMN_GAP` text heights wide, with text on both sides) is a pair
   of side-by-side blocks. When the two sides' lines do not line up (on each side a good share
   of the lines shares no row with the other side, :data:`UNALIGNED_SHARE`), they are
   independent columns: nothing is merged across the gutter and the left column is read
   before the right one (each read by these same rules, so three columns work too). When they
   do line up, the block is a table or a form of label/value pairs and its rows are read
   across, one line per row.
3. **Spaces.** Neighbouring segments of a line are joined with one space (characters that
   two overlapping detections both read are dropped once). Inside a segment, a recogniser
   that dropped the space between two words (PP-OCR often does) gets it back from the
   character positions and the blank columns between them: :func:`restore_spaces`.

Every line keeps the segments it was made of (:attr:`Segment.parts`), so a consumer can
assemble them differently.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from rapidfuzz.distance import Levenshtein

COLUMN_GAP = 2.0
"""Narrowest gutter between two side-by-side blocks, in mean text heights (segment box heights)
of the rows around it. On ``../shared/samples`` neighbouring segments of a row are 0.6, 2.7 and
8.1 heights apart (10th, 50th, 90th percentile: a receipt's label and its price are far apart);
the 36 blocks found there have gutters of 2.0 to 7.1 heights, and all of them line up
(:data:`UNALIGNED_SHARE`): a gutter alone never splits a line (``docs/lines.md``)."""
UNALIGNED_SHARE = 0.3
"""Share of a block's segments (of those level with the block across the gutter) that must
share no row with the other block (the row rule of step 1, after undoing the page's skew:
the median slope of the segments' top edges), on both sides, for the two blocks to be read as
independent columns."""

HEIGHT_APART = 1.4
"""Two side-by-side blocks whose median segment heights differ by this factor are two regions
(:func:`_apart`). On ``../shared/samples`` (PP-OCRv6 small's boxes) the blocks whose sides hold two
segments or more differ by at most 1.27 (a FUNSD form's attorney block), a receipt's by at most
1.22; the generated product label (24 px type beside 40 px, ``tests/pages.py``) by 1.64."""
REGION_GAP = 5.0
"""A gutter at least this many mean text heights wide, and :data:`REGION_GAP_RATIO` times the
widest gap inside either side, parts two tables side by side (:func:`_apart`). On the samples
the five blocks whose two sides both have inner gaps (receipt columns, read row by row in their
ground truth) have gutters of 2.0 to 2.2 heights; the generated key/value form 7.1 heights, 2.2
times its widest gap between a key and its value."""
REGION_GAP_RATIO = 2.0


@dataclass(frozen=True)
class SpaceRule:
    """When :func:`restore_spaces` puts a space between two characters of one segment: their
    columns between the two centres hold a blank run (no ink from top to bottom) at least
    ``blank`` times the height of the segment's ink *and* the centres are at least ``pitch``
    times the segment's median character pitch apart (:data:`WIDE_FACTOR` times more next to a
    :data:`WIDE_CHARS` letter); or, whatever their distance, a blank run of ``blank_wide``
    heights. Each recogniser has its own (:data:`SPACES_PP_OCRV4`, :data:`SPACES_PP_OCRV6`),
    measured with ``python -m bench.space_rules`` (``docs/lines.md``)."""

    blank: float
    pitch: float
    blank_wide: float = math.inf


SPACES_PP_OCRV4 = SpaceRule(blank=0.25, pitch=1.3, blank_wide=0.45)
"""PP-OCRv4 (rapidocr-onnxruntime 1.4.4). Measured on ``../shared/samples``: of 5,451
neighbouring character pairs of its output aligned to the ground truth, 769 have a space in the
truth and the recogniser kept 350; with this rule 272 of the 419 dropped spaces come back and 15
go where the truth has none; the pitch alone (at 1.5) restores 240 for 39 wrong, a blank of
0.25 alone 334 for 138 wrong."""
SPACES_PP_OCRV6 = SpaceRule(blank=0.45, pitch=1.3)
"""PP-OCRv6 small (rapidocr 3.10.0): it keeps 722 of the 822 true spaces of 5,891 aligned pairs,
and its characters' positions (from its CTC columns) say less: the v4 rule would put back 27 of
the 100 dropped for 31 wrong, the pitch alone (at 1.5) 20 for 121 wrong. This one puts back 12
for 2 wrong; a blank of 0.45 alone 13 for 4."""
WIDE_CHARS = frozenset("mwMW@%")
"""Letters whose advance is clearly wider than the median pitch ("MULTIPART": M to U is 1.3
pitches with no space between them)."""
WIDE_FACTOR = 1.1
MIN_PITCHES = 3
"""Fewest character-to-character distances a segment needs before spaces are restored in it."""


@dataclass(frozen=True)
class Segment:
    """One piece of text an engine found, or a line assembled from such pieces.

    Attributes:
        box: 4 corner points ``[[x, y], ...]`` in pixels of the page the engine saw.
        text: Recognised text.
        confidence: Confidence score in [0, 1].
        parts: For a line made by :func:`group_lines`: the segments it was made of, left to
            right (empty for an engine's own segment).
    """

    box: list[list[float]]
    text: str
    confidence: float
    parts: tuple["Segment", ...] = field(default=(), compare=False)

    @property
    def top(self) -> float:
        return min(p[1] for p in self.box)

    @property
    def bottom(self) -> float:
        return max(p[1] for p in self.box)

    @property
    def left(self) -> float:
        return min(p[0] for p in self.box)

    @property
    def right(self) -> float:
        return max(p[0] for p in self.box)

    @property
    def height(self) -> float:
        return self.bottom - self.top


def restore_spaces(text: str, centres: list[float], ink: list[bool], ink_height: float,
                   rule: SpaceRule = SPACES_PP_OCRV4) -> str:
    """Put back the spaces a recogniser dropped between the words of one segment.

    A space goes between two neighbouring characters (neither a space nor a CJK ideograph) when
    ``rule`` says so (:class:`SpaceRule`: the blank run between their centres, in ``ink_height``
    units, and their distance in median pitches). Characters the recogniser already separated
    by a space stay so and do not count towards the median.

    Args:
        text: The segment's text as recognised.
        centres: Position of every character of ``text`` (spaces included) along the text, in
            columns of ``ink`` (pixels of the segment's upright crop), increasing.
        ink: One entry per column of the crop: True where the column holds ink.
        ink_height: Height in pixels of the crop's inked rows (first to last).
        rule: The recogniser's :class:`SpaceRule`.

    Returns:
        ``text`` with spaces inserted; ``text`` unchanged when the positions do not match it
        (another length, not increasing) or there are fewer than :data:`MIN_PITCHES` distances
        to measure.
    """
    if len(centres) != len(text) or len(text) < 2 or ink_height <= 0:
        return text
    chars: list[tuple[str, float, bool]] = []  # (character, centre, a space before it)
    gap = False
    for ch, c in zip(text, centres):
        if ch.isspace():
            gap = True
            continue
        chars.append((ch, c, gap))
        gap = False
    steps = [b[1] - a[1] for a, b in zip(chars, chars[1:])]
    if any(d < 0 for d in steps):
        return text
    plain = [d for d, b in zip(steps, chars[1:]) if not b[2] and d > 0]
    if len(plain) < MIN_PITCHES:
        return text
    pitch = statistics.median(plain)
    out = [chars[0][0]]
    for (a, ca, _), (b, cb, spaced), d in zip(chars, chars[1:], steps):
        if spaced:
            out.append(" ")
        elif not (_is_cjk(a) or _is_cjk(b)):
            blank = _blank_run(ink, ca, cb) / ink_height
            wide = WIDE_FACTOR if a in WIDE_CHARS or b in WIDE_CHARS else 1.0
            if blank >= rule.blank_wide or (blank >= rule.blank and d >= rule.pitch * wide * pitch):
                out.append(" ")
        out.append(b)
    return "".join(out)


def _blank_run(ink: list[bool], a: float, b: float) -> int:
    """The widest run of columns without ink strictly between positions ``a`` and ``b``."""
    best = run = 0
    for x in range(max(0, math.ceil(a)), min(len(ink), math.floor(b) + 1)):
        run = 0 if ink[x] else run + 1
        best = max(best, run)
    return best


def _is_cjk(ch: str) -> bool:
    return "\u2e80" <= ch <= "\u9fff" or "\uf900" <= ch <= "\ufaff" or "\uac00" <= ch <= "\ud7af"


def group_lines(segments: list[Segment], min_overlap: float = 0.5) -> list[Segment]:
    """Assemble one page's segments into text lines, in reading order (module docstring).

    Args:
        segments: Segments of one page, any order.
        min_overlap: Fraction of the smaller height two segments must overlap to share a row.

    Returns:
        One segment per text line, in reading order: top to bottom, and column by column where
        the page has independent columns. A line's box is the axis-aligned quad around its
        segments, its confidence their character-weighted mean, its ``parts`` the segments
        themselves, left to right.
    """
    segs = [s for s in segments if s.text.strip()]
    if not segs:
        return []
    skew = _skew(segs)
    return [_line(row) for row in _read(segs, min_overlap, skew)]


def _read(segs: list[Segment], min_overlap: float, skew: float) -> list[list[Segment]]:
    """The rows of ``segs`` in reading order, each a list of segments left to right."""
    rows = _rows(segs, min_overlap)
    out: list[list[Segment]] = []
    i = 0
    while i < len(rows):
        j, gutter = _block(rows, i)
        if gutter is not None:
            block = [s for row in rows[i:j] for s in row]
            left = [s for s in block if s.right <= gutter[0]]
            right = [s for s in block if s.left >= gutter[1]]
            if _independent(left, right, skew, min_overlap) or _apart(left, right, gutter):
                out += _read(left, min_overlap, skew)
                out += _read(right, min_overlap, skew)
                i = j
                continue
        out += rows[i:j]
        i = j
    return out


def _rows(segs: list[Segment], min_overlap: float) -> list[list[Segment]]:
    """Segments grouped into rows (vertical overlap >= ``min_overlap`` of the smaller height,
    no horizontal overlap), rows top to bottom, each left to right."""
    rows: list[list[Segment]] = []
    for seg in sorted(segs, key=lambda s: (s.top + s.bottom) / 2):
        best, best_ov = None, 0.0
        for row in rows:
            top = min(s.top for s in row)
            bottom = max(s.bottom for s in row)
            ov = min(bottom, seg.bottom) - max(top, seg.top)
            h = min(bottom - top, seg.bottom - seg.top) or 1.0
            if ov / h >= min_overlap and ov / h > best_ov and not any(_overlap_x(seg, s) for s in row):
                best, best_ov = row, ov / h
        if best is None:
            rows.append([seg])
        else:
            best.append(seg)
    for row in rows:
        row.sort(key=lambda s: s.left)
    rows.sort(key=lambda r: (min(s.top for s in r) + max(s.bottom for s in r)) / 2)
    return rows


def _block(rows: list[list[Segment]], i: int) -> tuple[int, tuple[float, float] | None]:
    """The longest run of rows from ``rows[i]`` that share a gutter: ``(end, (x0, x1))``, or
    ``(i + 1, None)`` when ``rows[i]`` and ``rows[i + 1]`` share none.

    A row leaves free every x outside its segments; the run's gutter is the widest interval
    free in all its rows and bounded by text on both sides (some row's segment ends at its left
    edge, some row's begins at its right edge), at least :data:`COLUMN_GAP` mean heights wide.
    Time: linear in the run's length (each row's free intervals are intersected once).
    """
    free = _free(rows[i])
    heights = sum(s.height for s in rows[i])
    count = len(rows[i])
    best: tuple[int, tuple[float, float]] | None = None
    j = i + 1
    while j < len(rows):
        free = _intersect(free, _free(rows[j]))
        heights += sum(s.height for s in rows[j])
        count += len(rows[j])
        wide = COLUMN_GAP * (heights / count or 1.0)
        inner = [(a, b) for a, b in free if math.isfinite(a) and math.isfinite(b) and b - a >= wide]
        if not inner:
            break
        free = [g for g in free if not math.isfinite(g[0]) or not math.isfinite(g[1]) or g in inner]
        best = (j + 1, max(inner, key=lambda g: g[1] - g[0]))
        j += 1
    return best if best is not None else (i + 1, None)


def _free(row: list[Segment]) -> list[tuple[float, float]]:
    """The x-intervals that no segment of ``row`` covers (the outer two unbounded)."""
    out, at = [], -math.inf
    for s in sorted(row, key=lambda s: s.left):
        if s.left > at:
            out.append((at, s.left))
        at = max(at, s.right)
    out.append((at, math.inf))
    return out


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for a0, a1 in a:
        for b0, b1 in b:
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                out.append((lo, hi))
    return out


def _skew(segs: list[Segment]) -> float:
    """Tangent of the page's text angle: the median slope of the segments' top edges (those at
    least twice as wide as tall, whose angle is measurable)."""
    slopes = []
    for s in segs:
        (x0, y0), (x1, y1) = s.box[0], s.box[1]
        if x1 - x0 > 2 * s.height > 0:
            slopes.append((y1 - y0) / (x1 - x0))
    return statistics.median(slopes) if slopes else 0.0


def _independent(left: list[Segment], right: list[Segment], skew: float, min_overlap: float) -> bool:
    """Whether two side-by-side blocks are independent columns rather than one table: on *each*
    side, at least :data:`UNALIGNED_SHARE` of the segments level with the other side share no
    row with it. (In a table the sparser side lines up with the denser one: a price on every
    other row of a receipt still sits on a row of the item names.)"""
    if len(left) < 2 or len(right) < 2:
        return False

    def extent(s: Segment) -> tuple[float, float]:  # vertical extent, the page's skew undone
        shift = skew * (s.left + s.right) / 2
        return s.top - shift, s.bottom - shift

    def unaligned(side: list[Segment], other: list[Segment]) -> float:
        ext = [extent(o) for o in other]
        lo, hi = min(t for t, _ in ext), max(b for _, b in ext)
        level = 0
        alone = 0
        for s in side:
            top, bottom = extent(s)
            if bottom <= lo or top >= hi:
                continue  # above or below the other side: says nothing
            level += 1
            if not any(min(bottom, b) - max(top, t) >= min_overlap * (min(bottom - top, b - t) or 1.0)
                       for t, b in ext):
                alone += 1
        return alone / level if level else 0.0

    return unaligned(left, right) >= UNALIGNED_SHARE and unaligned(right, left) >= UNALIGNED_SHARE


def _apart(left: list[Segment], right: list[Segment], gutter: tuple[float, float]) -> bool:
    """Whether two side-by-side blocks whose lines line up (:func:`_independent` says a table)
    are still two regions, read one after the other rather than row by row across:

    * their **heights disagree**: the median segment height of one side is at least
      :data:`HEIGHT_APART` times the other's, each side holding at least two segments (a label
      in small type beside lines in large type); or
    * the **gap is wide**: the gutter is at least :data:`REGION_GAP` mean text heights wide and
      at least :data:`REGION_GAP_RATIO` times the widest gap between neighbouring segments of a
      row inside either side, and each side has such a gap (each side is itself a table: two
      groups of keys and values, not a receipt's items and prices).
    """
    if len(left) < 2 or len(right) < 2:
        return False
    hl, hr = statistics.median(s.height for s in left), statistics.median(s.height for s in right)
    if min(hl, hr) > 0 and max(hl, hr) / min(hl, hr) >= HEIGHT_APART:
        return True
    height = statistics.mean(s.height for s in left + right) or 1.0
    width = gutter[1] - gutter[0]
    inner = [_widest_gap(left), _widest_gap(right)]
    return min(inner) > 0 and width >= REGION_GAP * height and width >= REGION_GAP_RATIO * max(inner)


def _widest_gap(side: list[Segment]) -> float:
    """The widest horizontal gap between neighbouring segments of one row of ``side`` (0: none)."""
    best = 0.0
    for row in _rows(side, 0.5):
        for a, b in zip(row, row[1:]):
            best = max(best, b.left - a.right)
    return best


def _line(row: list[Segment]) -> Segment:
    """One line from a row of segments (left to right)."""
    left, right = min(s.left for s in row), max(s.right for s in row)
    top, bottom = min(s.top for s in row), max(s.bottom for s in row)
    chars = sum(max(1, len(s.text)) for s in row)
    conf = sum(s.confidence * max(1, len(s.text)) for s in row) / chars
    return Segment(box=[[left, top], [right, top], [right, bottom], [left, bottom]], text=_join_row(row),
                   confidence=min(1.0, max(0.0, conf)), parts=tuple(row))


def _join_row(row: list[Segment]) -> str:
    """Join a row's segments left to right with spaces.

    Where two neighbouring detections overlap horizontally, the detector often read the
    overlapped characters twice ("QTY 1" + "12 PCS"); the repeated characters are dropped
    from the left segment when its last characters equal the right segment's first ones
    (at most as many as the overlap is wide, estimated from the left segment's character width:
    k characters only where the overlap is at least k - 1/2 of them, so two words whose boxes
    touch, "AFTER" + "REFUSED" 1 px apart, keep their letters).
    """
    parts = [row[0].text.strip()]
    for a, b in zip(row, row[1:]):
        text_b = b.text.strip()
        overlap = a.right - b.left
        left = parts[-1]
        if overlap > 0 and left:
            char_w = max(1.0, (a.right - a.left) / len(left))
            most = min(len(left) - 1, len(text_b), int(overlap / char_w + 0.5))
            for k in range(most, 0, -1):
                if left[-k:] == text_b[:k]:
                    parts[-1] = left[:-k].rstrip()
                    break
        parts.append(text_b)
    return " ".join(p for p in parts if p)


def _overlap_x(a: Segment, b: Segment) -> bool:
    """True if two segments overlap horizontally by more than half the narrower one."""
    ov = min(a.right, b.right) - max(a.left, b.left)
    return ov > 0.5 * min(a.right - a.left, b.right - b.left)


def normalize_text(text: str) -> str:
    """Case-folded, whitespace-collapsed text used for CER (the SROIE ground truth is upper case)."""
    return " ".join(text.split()).casefold()


def cer(reference: str, hypothesis: str) -> float:
    """Character error rate: Levenshtein distance / reference length, on normalised text.

    Source: the standard definition (edit distance over characters, as in jiwer's ``cer``).
    Returns 0.0 for two empty strings and 1.0 for an empty reference with a non-empty hypothesis.
    """
    ref, hyp = normalize_text(reference), normalize_text(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    return Levenshtein.distance(ref, hyp) / len(ref)
