"""Result assembly: engine segments -> text lines in reading order, and the CER metric."""

from __future__ import annotations

from dataclasses import dataclass

from rapidfuzz.distance import Levenshtein


@dataclass(frozen=True)
class Segment:
    """One piece of text an engine found.

    Attributes:
        box: 4 corner points ``[[x, y], ...]`` in pixels of the page the engine saw.
        text: Recognised text.
        confidence: Confidence score in [0, 1].
    """

    box: list[list[float]]
    text: str
    confidence: float

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


def group_lines(segments: list[Segment], min_overlap: float = 0.5) -> list[Segment]:
    """Merge segments that sit on one row into text lines, in reading order.

    Two segments share a row when their vertical extents overlap by at least ``min_overlap``
    of the smaller height. Within a row, segments are ordered left to right and joined with a
    space; rows are ordered top to bottom. The line's box is the axis-aligned quad around its
    segments; its confidence is the character-weighted mean.

    Args:
        segments: Segments of one page, any order.
        min_overlap: Fraction of the smaller height two segments must overlap to share a row.

    Returns:
        One segment per text line, top to bottom.
    """
    rows: list[list[Segment]] = []
    for seg in sorted((s for s in segments if s.text.strip()), key=lambda s: (s.top + s.bottom) / 2):
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
    lines = []
    for row in rows:
        row.sort(key=lambda s: s.left)
        left, right = min(s.left for s in row), max(s.right for s in row)
        top, bottom = min(s.top for s in row), max(s.bottom for s in row)
        chars = sum(max(1, len(s.text)) for s in row)
        conf = sum(s.confidence * max(1, len(s.text)) for s in row) / chars
        lines.append(
            Segment(
                box=[[left, top], [right, top], [right, bottom], [left, bottom]],
                text=_join_row(row),
                confidence=min(1.0, max(0.0, conf)),
            )
        )
    lines.sort(key=lambda s: (s.top + s.bottom) / 2)
    return lines


def _join_row(row: list[Segment]) -> str:
    """Join a row's segments left to right with spaces.

    Where two neighbouring detections overlap horizontally, the detector often read the
    overlapped characters twice ("QTY 1" + "12 PCS"); the repeated characters are dropped
    from the left segment when its last characters equal the right segment's first ones
    (at most as many as the overlap is wide, estimated from the left segment's character width).
    """
    parts = [row[0].text.strip()]
    for a, b in zip(row, row[1:]):
        text_b = b.text.strip()
        overlap = a.right - b.left
        left = parts[-1]
        if overlap > 0 and left:
            char_w = max(1.0, (a.right - a.left) / len(left))
            most = min(len(left) - 1, len(text_b), round(overlap / char_w) + 1)
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
