"""HunyuanOCR text spotting: parsing the model's answer into segments (coordinates, lines, the
runaway-repetition guard). What is sent to the model (messages, template, sampling) is in
:mod:`services.infer.engines.hunyuan_prompts`, the prompts in :mod:`services.common.cache.prompts`.

The model answers ``spotting_hunyuan`` (:data:`~services.common.cache.prompts.SPOTTING_PROMPT`) with
items ``text(x1,y1),(x2,y2)`` (top-left, bottom-right), back to back or one per line, the
coordinates normalised to 0..1000 of the image's width and height; ``spotting_json``
(:data:`~services.common.cache.prompts.SPOTTING_JSON_PROMPT`) answers a JSON array
``[{"box": [xmin, ymin, xmax, ymax], "text": "..."}]`` on the same 0..1000 scale.
The official scorer (``train_verl/reward/task_scorers/spotting.py``) also reads two tagged
forms, ``<ref>text</ref><quad>(x1,y1),(x2,y2)</quad>`` and
``<quad><pos_x1><pos_y1><pos_x2><pos_y2></quad><ref>text</ref>``; :func:`parse_spotting` reads
all four.

Confidence: a VLM gives no per-line score. Every segment gets :data:`VLM_CONFIDENCE` (1.0).
Token log-probabilities could give a page-level figure, but vLLM exposes no mapping from
tokens to the lines parsed out of the text, so a per-line value would be made up.

Nothing here needs vLLM, torch or a network: it is plain text and geometry, unit tested on
recorded answers.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field

import numpy as np

from schemas.reading import WARNING_TRUNCATED_REPETITION, WARNING_UNPARSED_OUTPUT
from services.infer.textlines import Segment
from services.infer.engines.base import EngineOutput

log = logging.getLogger(__name__)

#: Confidence given to every VLM segment (the model has no per-line score).
VLM_CONFIDENCE = 1.0
#: Coordinates are normalised to 0..SCALE.
SCALE = 1000.0


@dataclass
class ParseStats:
    """What :func:`parse_spotting` saw, for logs and tests."""

    format: str = "empty"
    items: int = 0
    kept: int = 0
    malformed: int = 0
    duplicates: int = 0
    runaway: int = 0
    tail_trimmed: bool = False
    notes: list[str] = field(default_factory=list)


_NUM = r"(-?\d+(?:\.\d+)?)"
# The model sometimes writes the coordinates with full-width punctuation: （10,20），（30,40）.
_LP, _RP, _CM = "[(（]", "[)）]", "[,，]"
_PAIR = re.compile(
    rf"{_LP}\s*{_NUM}\s*{_CM}\s*{_NUM}\s*{_RP}\s*{_CM}\s*{_LP}\s*{_NUM}\s*{_CM}\s*{_NUM}\s*{_RP}"
)
_N = r"-?\d+(?:\.\d+)?"
# What is left of a coordinate pair that did not parse: its second half, a numeric pair after
# a ")," joint (``(a,b),(3,4)``, ``1,2),(3,4)``), or two numeric pairs with the comma between
# them missing. Text such as ``f(x),(y)`` has no numeric second half and is left alone.
_DEBRIS = re.compile(
    rf"{_RP}\s*{_CM}\s*{_LP}\s*{_N}\s*{_CM}\s*{_N}\s*{_RP}"
    rf"|{_LP}\s*{_N}\s*{_CM}\s*{_N}\s*{_RP}\s*{_LP}\s*{_N}\s*{_CM}\s*{_N}\s*{_RP}"
)
_REF_QUAD = re.compile(r"<ref>(.*?)</ref>\s*<quad>(.*?)</quad>", re.S)
_QUAD_REF = re.compile(r"<quad>((?:\s*<pos_[^>]*>){4})\s*</quad>\s*<ref>(.*?)</ref>", re.S)
_POS = re.compile(r"<pos_\s*(-?\d+(?:\.\d+)?)\s*>")
_FENCE = re.compile(r"^\s*```[a-zA-Z]*\s*\n?|\n?\s*```\s*$")
_TEXT_KEYS = ("text", "content", "transcription", "words", "label")
_BOX_KEYS = ("box", "bbox", "quad", "polygon", "points", "coordinates", "position")


#: Loop guard thresholds (see :func:`find_tail_loop`). A unit must hold at least this many
#: distinct non-space characters, so runs of one character (``________``, ``1000000000``,
#: dotted leaders ``........`` or ``. . . .``) and two-character patterns (``-=-=``) never
#: count as a loop: forms and tables are full of them.
LOOP_MIN_DISTINCT = 3
#: ... repeated back to back at least this many times ...
LOOP_MIN_REPEATS = 8
#: ... covering at least this many characters (a 4-character unit needs 64 copies, an item
#: ``text(x1,y1),(x2,y2)`` of 20 characters 13 copies: far beyond any real page, and a loop
#: that long costs only a few hundred tokens before it is caught).
LOOP_MIN_SPAN = 256
#: Or: the last complete output lines are this many copies of one line (with at least
#: :data:`LOOP_MIN_DISTINCT` distinct non-space characters). In spotting output every line
#: carries its own coordinates, so identical lines are never two real text lines.
LOOP_MIN_LINES = 12
#: Longest unit looked for, in characters.
LOOP_MAX_UNIT = 400


def _distinct(unit: str) -> int:
    return len({c for c in unit if not c.isspace()})


def find_tail_loop(
    text: str,
    *,
    min_repeats: int = LOOP_MIN_REPEATS,
    min_span: int = LOOP_MIN_SPAN,
    min_lines: int = LOOP_MIN_LINES,
    max_unit: int = LOOP_MAX_UNIT,
) -> int | None:
    """Where a runaway loop at the end of ``text`` begins its second copy, or None.

    A loop is either (a) a unit of 1..``max_unit`` characters with at least
    :data:`LOOP_MIN_DISTINCT` distinct non-space characters, repeated back to back at least
    ``min_repeats`` times and over at least ``min_span`` characters, ending the text (the text
    may stop inside a copy: any rotation of the unit matches); or (b) the last ``min_lines``
    complete lines are the same line (compared stripped, with at least
    :data:`LOOP_MIN_DISTINCT` distinct non-space characters). Runs of one or two characters
    never count, however long: ``Signature: ________``, ``Total 1000000000``, ``Chapter 1
    ........ 5`` are text.

    Returns:
        The index where the repeated copies after the first begin (``text[:i]`` keeps one
        copy), or None when ``text`` does not end in a loop.
    """
    n = len(text)
    for size in range(1, min(max_unit, n // max(2, min_repeats)) + 1):
        unit = text[n - size:]
        if _distinct(unit) < LOOP_MIN_DISTINCT:
            continue
        count, end = 1, n - size
        while end - size >= 0 and text[end - size:end] == unit:
            count += 1
            end -= size
        if count >= min_repeats and count * size >= min_span:
            return end + size
    lines = text.split("\n")
    complete = lines[:-1]  # the last piece is a line still being written (or "")
    if len(complete) >= min_lines:
        last = complete[-1].strip()
        if _distinct(last) >= LOOP_MIN_DISTINCT:
            run = 1
            while run < len(complete) and complete[-1 - run].strip() == last:
                run += 1
            if run >= min_lines:
                first = len(complete) - run  # index of the run's first line
                return sum(len(ln) + 1 for ln in lines[: first + 1])
    return None


def trim_repeated_tail(text: str, **kw) -> tuple[str, bool]:
    """Cut a runaway loop (see :func:`find_tail_loop`) off the end of a generation, keeping
    one copy.

    Returns:
        ``(text, trimmed)``.
    """
    cut = find_tail_loop(text, **kw)
    if cut is None:
        return text, False
    return text[:cut], True


def has_tail_repetition(text: str, **kw) -> bool:
    """True when ``text`` ends in a runaway loop (see :func:`find_tail_loop`)."""
    return find_tail_loop(text, **kw) is not None


def _num(v) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        f = float(v)
    elif isinstance(v, str):
        try:
            f = float(v.strip())
        except ValueError:
            return None
    else:
        return None
    return f if np.isfinite(f) else None


def _box_numbers(raw) -> list[float] | None:
    """A box value from JSON as 4 numbers (xmin, ymin, xmax, ymax) or 8 (a quad), else None."""
    if isinstance(raw, dict):
        keys = [("xmin", "ymin", "xmax", "ymax"), ("x1", "y1", "x2", "y2"), ("left", "top", "right", "bottom")]
        for ks in keys:
            if all(k in raw for k in ks):
                raw = [raw[k] for k in ks]
                break
        else:
            return None
    if isinstance(raw, str):
        raw = re.findall(r"-?\d+(?:\.\d+)?", raw)
    if not isinstance(raw, (list, tuple)):
        return None
    flat: list = []
    for v in raw:
        if isinstance(v, (list, tuple)):
            if len(v) != 2:
                return None
            flat.extend(v)
        else:
            flat.append(v)
    nums = [_num(v) for v in flat]
    if any(v is None for v in nums) or len(nums) not in (4, 8):
        return None
    return nums  # type: ignore[return-value]


def _json_items(body: str, stats: ParseStats) -> list[tuple[str, list[float]]] | None:
    """Items of the JSON form, or None when ``body`` is not JSON spotting output."""
    if not body.startswith(("[", "{")):
        return None
    objs: list = []
    try:
        data = json.loads(body)
        if isinstance(data, dict):
            data = next((v for v in data.values() if isinstance(v, list)), [data])
        if not isinstance(data, list):
            return None
        objs = data
    except (ValueError, RecursionError):  # RecursionError: thousands of nested brackets
        # Truncated or slightly broken array: salvage every complete flat object.
        for m in re.finditer(r"\{[^{}]*\}", body):
            try:
                objs.append(json.loads(m.group(0)))
            except (ValueError, RecursionError):
                stats.malformed += 1
        stats.notes.append("json salvaged")
        if not objs:
            return None
    items = []
    for obj in objs:
        if not isinstance(obj, dict):
            stats.malformed += 1
            continue
        text = next((obj[k] for k in _TEXT_KEYS if k in obj), None)
        box = next((obj[k] for k in _BOX_KEYS if k in obj), None)
        nums = _box_numbers(box)
        if text is None or nums is None:
            stats.malformed += 1
            continue
        items.append((str(text), nums))
    return items


def _tag_items(body: str, stats: ParseStats) -> list[tuple[str, list[float]]] | None:
    """Items of the two tagged forms, or None when there are no tags."""
    items: list[tuple[str, list[float]]] = []
    found = False
    for m in _REF_QUAD.finditer(body):
        found = True
        pm = _PAIR.search(m.group(2))
        if pm is None:
            stats.malformed += 1
            continue
        items.append((m.group(1), [float(g) for g in pm.groups()]))
    for m in _QUAD_REF.finditer(body):
        found = True
        nums = [float(g) for g in _POS.findall(m.group(1))]
        if len(nums) != 4:
            stats.malformed += 1
            continue
        items.append((m.group(2), nums))
    return items if found else None


def _plain_items(body: str, stats: ParseStats) -> list[tuple[str, list[float]]]:
    """Items of ``text(x1,y1),(x2,y2)``: each item's text is what precedes its coordinate pair,
    back to the previous pair. A gap holding several lines, or the debris of a pair that did
    not parse (``(a,b),(3,4)``, ``1,2),(3,4)``), holds malformed entries: only its last line,
    after the last debris, is the item's text. Text after the last pair (a truncated entry) is
    dropped."""
    items = []
    last = 0
    for m in _PAIR.finditer(body):
        gap = body[last:m.start()]
        last = m.end()
        # Extra pairs right after a pair ("Hello(1,2),(3,4),(5,6),(7,8)") bind to the first.
        if not re.search(r"[^\s(),（），]", gap):
            if items or gap.strip():
                stats.malformed += 1
            continue
        lines = [ln for ln in gap.split("\n") if ln.strip()]
        if len(lines) > 1:
            stats.malformed += len(lines) - 1
        text = lines[-1]
        debris = list(_DEBRIS.finditer(text))
        if debris:
            stats.malformed += 1
            text = text[debris[-1].end():]
        text = text.strip().lstrip(",，").strip()
        if not text:
            stats.malformed += 1
            continue
        items.append((text, [float(g) for g in m.groups()]))
    if body[last:].strip():
        stats.malformed += 1
        stats.notes.append("truncated tail")
    return items


def _to_pixels(nums: list[float], width: int, height: int) -> list[list[float]] | None:
    """0..1000 numbers -> 4 pixel corners clockwise from top-left, clamped to the image."""
    sx, sy = width / SCALE, height / SCALE

    def px(x: float, y: float) -> list[float]:
        x = min(SCALE, max(0.0, x)) * sx
        y = min(SCALE, max(0.0, y)) * sy
        return [round(x, 1), round(y, 1)]

    if len(nums) == 4:
        x1, y1, x2, y2 = nums
        x1, x2 = sorted((x1, x2))
        y1, y2 = sorted((y1, y2))
        tl, br = px(x1, y1), px(x2, y2)
        if br[0] - tl[0] <= 0 or br[1] - tl[1] <= 0:
            return None
        return [tl, [br[0], tl[1]], br, [tl[0], br[1]]]
    pts = [px(nums[i], nums[i + 1]) for i in range(0, 8, 2)]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if max(xs) - min(xs) <= 0 or max(ys) - min(ys) <= 0:
        return None
    return pts


def _overlap(a: list[list[float]] | None, b: list[list[float]] | None) -> bool:
    """True when the axis-aligned extents of boxes ``a`` and ``b`` (4 corner points, px) intersect."""
    if a is None or b is None:
        return False
    ax0, ax1 = min(p[0] for p in a), max(p[0] for p in a)
    ay0, ay1 = min(p[1] for p in a), max(p[1] for p in a)
    bx0, bx1 = min(p[0] for p in b), max(p[0] for p in b)
    by0, by1 = min(p[1] for p in b), max(p[1] for p in b)
    return ax0 < bx1 and bx0 < ax1 and ay0 < by1 and by0 < ay1


def parse_spotting(
    text: str,
    width: int,
    height: int,
    *,
    max_run: int = 12,
    clip: tuple[int, int] | None = None,
    stats: ParseStats | None = None,
) -> list[Segment]:
    """HunyuanOCR text-spotting output -> segments in pixels of the image the model saw.

    Reads ``text(x1,y1),(x2,y2)`` items (one per line or back to back; text may hold
    parentheses; the coordinates may use full-width ``（，）``), the two tagged forms, and the JSON form (``box``/``bbox``/``quad``/... with 4
    numbers or 4 points; ``text``/``content``/...; a truncated array is salvaged object by
    object; an answer that starts with ``[`` or ``{`` but gives no JSON entry is read as the
    plain form instead). ``<answer>`` wrappers and Markdown code fences are removed first.

    Coordinates are on a 0..1000 scale of ``width`` x ``height``; values outside are clamped to
    the image, corners are ordered, and a box of zero width or height after clamping is dropped.
    Malformed entries (no or non-numeric coordinates, missing parentheses, wrong counts,
    truncated last entry) are skipped, never raised.

    Runaway guard: a loop at the end of the raw text (see :func:`find_tail_loop`; runs of one
    character are text, never a loop) is trimmed to one copy; an entry identical to an earlier
    one (same text and box) is dropped; a run of more than ``max_run`` consecutive entries with
    the same text, each box overlapping the one before, keeps only the first ``max_run``
    (``stats.runaway`` counts the rest; the engines flag the result ``truncated_repetition``).
    Same-text entries in separate boxes (a table column of ``0``) are all kept.

    Args:
        text: The model's answer.
        width, height: Size in pixels of the image sent to the model.
        max_run: Longest run of consecutive same-text entries kept.
        clip: ``(width, height)`` to clamp boxes to, when the image sent was padded.
        stats: Filled with counts of what was seen, if given.

    Returns:
        One :class:`Segment` per entry, in output order, confidence :data:`VLM_CONFIDENCE`.
    """
    st = stats if stats is not None else ParseStats()
    if not text or not text.strip() or width <= 0 or height <= 0:
        return []
    body = text
    m = re.search(r"<answer>(.*?)(?:</answer>|$)", body, re.S)
    if m:
        body = m.group(1)
    body, st.tail_trimmed = trim_repeated_tail(body)
    body = _FENCE.sub("", body.strip()).strip()

    items = _json_items(body, st)
    st.format = "json"
    if not items:
        # Not the JSON variant after all (``[Note] text(1,2),(3,4)``, ``{x}...``): read it as
        # the other forms; a JSON answer with no usable entry reads as nothing there too.
        if items is not None:
            st.notes.append("json had no entries; read as text")
        items = None
        st.malformed = 0
        items = _tag_items(body, st)
        st.format = "tagged"
    if items is None:
        items = _plain_items(body, st)
        st.format = "plain"
    st.items = len(items)

    cw, ch = clip if clip else (width, height)
    out: list[Segment] = []
    seen: set[tuple] = set()
    run_text, run_box, run_len = None, None, 0
    for raw_text, nums in items:
        t = " ".join(raw_text.split())
        box = _to_pixels(nums, width, height)
        if box is None or not t:
            st.malformed += 1
            continue
        if clip:
            box = [[min(float(cw), x), min(float(ch), y)] for x, y in box]
            if max(p[0] for p in box) - min(p[0] for p in box) <= 0 or max(p[1] for p in box) - min(p[1] for p in box) <= 0:
                st.malformed += 1
                continue
        key = (t, tuple(tuple(p) for p in box))
        if key in seen:
            st.duplicates += 1
            continue
        seen.add(key)
        # a loop repeats a text over the same place; a table column of "0" or "N/A" puts it in
        # separate cells, which are kept however many there are
        run_len = run_len + 1 if t == run_text and _overlap(box, run_box) else 1
        run_text, run_box = t, box
        if run_len > max_run:
            st.runaway += 1
            continue
        out.append(Segment(box=box, text=t, confidence=VLM_CONFIDENCE))
    st.kept = len(out)
    if st.malformed or st.duplicates or st.runaway or st.tail_trimmed:
        log.debug("hunyuan parse: %s", st)
    return out


def answer_to_output(text: str, sent: tuple[int, int], image: tuple[int, int], warnings: tuple[str, ...],
                     started: float) -> EngineOutput | RuntimeError:
    """One image's model answer as the VLM engines return it.

    Args:
        text: The model's answer.
        sent: ``(width, height)`` in pixels of the (padded) image sent to the model.
        image: ``(width, height)`` of the image before padding; boxes are clamped to it.
        warnings: The generation's own warnings (``truncated_max_tokens``, ...).
        started: ``time.perf_counter()`` when the image's request began (for ``inference_ms``).

    Returns:
        An :class:`EngineOutput`, flagged ``truncated_repetition`` when the parser cut a loop,
        or a ``RuntimeError`` when the parser itself fails: that image's engine error, never
        the whole batch's.

        A non-empty answer from which no entry parses (prose, a bare transcription, boxes the
        parser cannot read) is not dropped: the image stays ``ok``, carries the warning
        ``unparsed_output``, and has one segment holding the answer's text (see
        :func:`unparsed_text`) whose box is the whole image (``image``, in pixels) and whose
        confidence is 0.0, since nothing says where the text is. An empty (or blank) answer, or
        one that only says there is no text (:data:`NO_TEXT_ANSWER`), is ``ok`` with no segment
        and no warning: the page has no text.
    """
    stats = ParseStats()
    try:
        segs = parse_spotting(text, *sent, clip=image if sent != image else None, stats=stats)
    except Exception as exc:  # noqa: BLE001 - see Returns
        return RuntimeError(f"model output of {len(text)} characters could not be parsed: {exc!r}")
    if (stats.tail_trimmed or stats.runaway) and WARNING_TRUNCATED_REPETITION not in warnings:
        warnings = (*warnings, WARNING_TRUNCATED_REPETITION)
    if not segs:
        raw = unparsed_text(text)
        if raw and NO_TEXT_ANSWER.match(raw):
            raw = ""
        if raw and image[0] > 0 and image[1] > 0:
            w, h = float(image[0]), float(image[1])
            log.info("hunyuan: answer of %d characters has no text(box) entry; kept as one line", len(text))
            segs = [Segment(box=[[0.0, 0.0], [w, 0.0], [w, h], [0.0, h]], text=raw, confidence=0.0)]
            if WARNING_UNPARSED_OUTPUT not in warnings:
                warnings = (*warnings, WARNING_UNPARSED_OUTPUT)
    return EngineOutput(segs, (time.perf_counter() - started) * 1000, warnings)


NO_TEXT_ANSWER = re.compile(
    r"^\s*(?:图片中?没有(?:任何)?文字|图中没有文字|没有(?:识别到|检测到)?文字|(?:there is )?no text(?: (?:found|detected))?"
    r"(?: in (?:the|this) image)?)\s*[。.!！]?\s*$", re.I)
"""A whole answer that only says the page has no text (the forms VLMs such as HunyuanOCR give,
in Chinese or English): the page is ``ok`` with no line, like an empty answer."""


def unparsed_text(text: str) -> str:
    """The text of an answer :func:`parse_spotting` found no entry in, as one line: the
    ``<answer>`` wrapper, Markdown fences, the tags of the tagged forms and a runaway tail loop
    removed, whitespace runs (newlines included) joined into single spaces. Empty when nothing
    is left."""
    body = text or ""
    m = re.search(r"<answer>(.*?)(?:</answer>|$)", body, re.S)
    if m:
        body = m.group(1)
    body, _ = trim_repeated_tail(body)
    body = _FENCE.sub("", body.strip())
    body = re.sub(r"</?(?:ref|quad|answer)>|<pos_[^>]*>", " ", body)
    return " ".join(body.split())
