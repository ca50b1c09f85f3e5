"""A task's result as a person reads it in a terminal (``ocrstream submit``): Markdown rendered,
HTML tables as tables, extracted fields as a two-column table.

What each task's result slot holds is in ``docs/tasks.md``: ``markdown`` (``doc_parse``,
``chart``: Markdown whose tables are HTML ``<table>`` elements, as HunyuanOCR writes them),
``html`` (``table``), ``latex`` (``formula``), ``fields`` (``extract``), ``translation``
(``translate``), and ``lines`` / ``text`` for ``ocr``. Markdown goes through
:class:`rich.markdown.Markdown` (markdown-it, CommonMark), which drops raw HTML, so the
``<table>`` elements are cut out first and turned into :class:`rich.table.Table` objects with the
standard library's :class:`html.parser.HTMLParser`. Nothing here prints: :func:`renderables`
returns what the caller's console prints.

Every string of the answer goes through :func:`safe_text` first: the model's text (or a hostile
server's, behind the ``openai`` engine) must not drive the terminal (rich passes ESC through).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

from rich.console import RenderableType
from rich.markdown import Markdown
from rich.table import Table
from rich.text import Text

_TABLE_TAG = re.compile(r"<(/?)table\b[^<>]*>", re.IGNORECASE)  # stops at "<": "<table" repeated is linear
_MAX_SPAN = 100  # a colspan/rowspan above this is read as 1 (a model's typo must not build a huge grid)
# a "<" that opens no tag closed before the next "<" is text: html.parser would rescan the rest of
# the input from each one (quadratic: 60 KB of "<a " took 74 s), so it gets "&lt;" first
_LONE_LT = re.compile(r"<(?![a-zA-Z/!][^<>]*>)")
_FENCE_OPEN = re.compile(r" {0,3}(`{3,}|~{3,})")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _visible(m: re.Match) -> str:
    c = ord(m.group())
    return chr(0x2400 + c) if c < 0x20 else "\u2421" if c == 0x7f else "\ufffd"


def safe_text(text: str) -> str:
    """``text`` with nothing a terminal would act on: line ends as ``\\n`` (``\\r\\n`` and a lone
    ``\\r`` too), tabs kept, every other C0 control shown as its Unicode control picture (ESC as
    ``␛``, NUL as ``␀``), DEL as ``␡``, C1 controls (``\\x80``-``\\x9f``, 8-bit CSI among them)
    as U+FFFD. rich's :class:`~rich.text.Text` drops only BEL, BS, VT, FF and CR and passes ESC
    through, so an answer holding ``\\x1b]52;c;…`` would write the clipboard, ``\\x1b[2J`` clear
    the screen."""
    return _CONTROL.sub(_visible, text.replace("\r\n", "\n").replace("\r", "\n"))


@dataclass
class HtmlTable:
    """One ``<table>`` as a grid of text: ``header`` rows (from ``<thead>``, or leading rows whose
    cells are all ``<th>``) and ``body`` rows, every row as wide as the widest. A cell spanning
    columns or rows (``colspan``/``rowspan``) holds its text in its first place and ``""`` in
    the others."""

    header: list[list[str]] = field(default_factory=list)
    body: list[list[str]] = field(default_factory=list)


class _TableParser(HTMLParser):
    """Collects the rows of every ``<table>`` in a piece of HTML (nested tables: their text goes
    into the enclosing cell). Only ``table``, ``thead``, ``tbody``, ``tr``, ``td``, ``th`` and
    ``br`` mean anything; every other tag is dropped and its text kept."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tables: list[list[tuple[list[tuple[str, int, int, bool]], bool]]] = []  # per table: its rows
        self._rows: list | None = None  # rows of the open table: ([(text, colspan, rowspan, is_th)], in_thead)
        self._cell: list[str] | None = None
        self._cell_attrs: tuple[int, int, bool] = (1, 1, False)
        self._thead = False
        self._depth = 0  # nesting of <table>

    @staticmethod
    def _span(attrs, name: str) -> int:
        raw = dict(attrs).get(name) or "1"
        try:
            n = int(raw.strip())
        except ValueError:
            return 1
        return n if 1 <= n <= _MAX_SPAN else 1

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._depth += 1
            if self._depth == 1:
                self._rows = []
            elif self._cell is not None:
                self._cell.append(" ")
            return
        if self._depth != 1 or self._rows is None:
            if self._cell is not None and tag in ("br", "tr", "td", "th"):
                self._cell.append("\n" if tag in ("br", "tr") else " ")  # a nested table's text, flattened
            return
        if tag == "thead":
            self._thead = True
        elif tag == "tr":
            self._close_cell()
            self._rows.append(([], self._thead))
        elif tag in ("td", "th"):
            self._close_cell()
            if not self._rows:
                self._rows.append(([], self._thead))
            self._cell = []
            self._cell_attrs = (self._span(attrs, "colspan"), self._span(attrs, "rowspan"), tag == "th")
        elif tag == "br" and self._cell is not None:
            self._cell.append("\n")

    def handle_endtag(self, tag):
        if tag == "table":
            if self._depth == 1 and self._rows is not None:
                self._close_cell()
                self.tables.append(self._rows)
                self._rows = None
            self._depth = max(0, self._depth - 1)
        elif self._depth == 1 and tag in ("td", "th", "tr"):
            self._close_cell()
        elif self._depth == 1 and tag == "thead":
            self._close_cell()
            self._thead = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def _close_cell(self):
        if self._cell is None or not self._rows:
            self._cell = None
            return
        lines = "".join(self._cell).split("\n")
        text = "\n".join(" ".join(ln.split()) for ln in lines).strip()
        self._rows[-1][0].append((text, *self._cell_attrs))
        self._cell = None


def _grid(rows: list[tuple[list[tuple[str, int, int, bool]], bool]]) -> HtmlTable:
    """Rows of (text, colspan, rowspan, is_th) cells placed on a grid (HTML's table model, simplified)."""
    placed: list[dict[int, str]] = []
    kinds: list[tuple[bool, bool]] = []  # (in thead, every cell th)
    for r, (cells, in_thead) in enumerate(rows):
        while len(placed) <= r:
            placed.append({})
        col = 0
        for text, colspan, rowspan, _ in cells:
            while col in placed[r]:
                col += 1
            for dr in range(rowspan):
                while len(placed) <= r + dr:
                    placed.append({})
                for dc in range(colspan):
                    placed[r + dr][col + dc] = text if dr == 0 and dc == 0 else ""
            col += colspan
        kinds.append((in_thead, bool(cells) and all(th for *_, th in cells)))
    width = max((max(row) + 1 for row in placed if row), default=0)
    grid = [[row.get(c, "") for c in range(width)] for row in placed[:len(rows)]]
    out = HtmlTable()
    heading = True
    for row, (in_thead, all_th) in zip(grid, kinds):
        if heading and (in_thead or all_th):
            out.header.append(row)
        else:
            heading = False
            out.body.append(row)
    return out


def parse_tables(html: str) -> list[HtmlTable]:
    """Every top-level ``<table>`` of ``html``, in order, as :class:`HtmlTable` grids (cell text
    with whitespace runs collapsed; ``<br>`` a line break; character references decoded); one
    never closed (an answer cut at ``max_tokens``) as far as it goes. Linear in ``html``'s length:
    a ``<`` that opens no complete tag is read as text before the parser sees it."""
    p = _TableParser()
    p.feed(_LONE_LT.sub("&lt;", html))
    p.close()
    if p._rows is not None:  # a table never closed (an answer cut at max_tokens): as far as it goes
        p._close_cell()
        p.tables.append(p._rows)
    return [_grid(rows) for rows in p.tables]


def rich_table(t: HtmlTable) -> Table:
    """A :class:`HtmlTable` as a rich table: its first header row as the column titles (further
    header rows bold, first in the body), lines between rows. Cells are plain text (never rich markup)."""
    width = len((t.header or t.body or [[]])[0])
    table = Table(show_header=bool(t.header), show_lines=True)
    titles = t.header[0] if t.header else [""] * width
    for title in titles:
        table.add_column(Text(safe_text(title)))
    for row in t.header[1:]:
        table.add_row(*(Text(safe_text(c)) for c in row), style="bold")
    for row in t.body:
        table.add_row(*(Text(safe_text(c)) for c in row))
    return table


def _escaped(text: str, at: int) -> bool:
    """Whether ``text[at]`` is backslash-escaped (an odd run of backslashes just before it)."""
    n = 0
    while at - n > 0 and text[at - n - 1] == "\\":
        n += 1
    return n % 2 == 1


def fenced_ranges(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of each fenced code block of ``text`` (CommonMark: a line of 3 or more
    backticks or tildes indented up to 3 spaces opens one, a line of at least as many of the same
    closes it; an unclosed one runs to the end)."""
    ranges: list[tuple[int, int]] = []
    pos, opened = 0, None  # (fence, start)
    for line in text.split("\n"):
        if opened is None:
            if m := _FENCE_OPEN.match(line):
                opened = (m.group(1), pos)
        elif re.match(rf" {{0,3}}{re.escape(opened[0][0])}{{{len(opened[0])},}}\s*$", line):
            ranges.append((opened[1], pos + len(line)))
            opened = None
        pos += len(line) + 1
    if opened is not None:
        ranges.append((opened[1], len(text)))
    return ranges


def table_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of each outermost ``<table>…</table>`` in ``text``, nested tables inside
    it; an unclosed one runs to the end. A ``<table>`` in a fenced code block
    (:func:`fenced_ranges`), or backslash-escaped (``\\<table>``: text, as the CPU engine
    writes a sign that looks like HTML), starts none."""
    spans: list[tuple[int, int]] = []
    depth = start = 0
    fenced = fenced_ranges(text)
    for m in _TABLE_TAG.finditer(text):
        if not m.group(1):
            at = m.start()
            if depth == 0 and (_escaped(text, at) or any(a <= at < b for a, b in fenced)):
                continue
            if depth == 0:
                start = at
            depth += 1
        elif depth > 0:
            depth -= 1
            if depth == 0:
                spans.append((start, m.end()))
    if depth > 0:
        spans.append((start, len(text)))
    return spans


def markdown_with_tables(markdown: str) -> list[RenderableType]:
    """Markdown as rich renderables in order: the text between tables as :class:`Markdown`, each
    ``<table>`` element as a :class:`Table` (rich's Markdown would drop it). Links are shown as
    their text and address (``hyperlinks=False``), never as terminal hyperlinks: the model could
    put one address in a link's text and another behind it."""
    out: list[RenderableType] = []
    pos = 0
    for start, end in table_spans(markdown):
        before = markdown[pos:start]
        if before.strip():
            out.append(Markdown(safe_text(before), hyperlinks=False))
        out.extend(rich_table(t) for t in parse_tables(markdown[start:end]))
        pos = end
    rest = markdown[pos:]
    if rest.strip():
        out.append(Markdown(safe_text(rest), hyperlinks=False))
    return out


def fields_table(fields: dict[str, str | None]) -> Table:
    """``extract``'s answer as a two-column table, ``field`` and ``value``, in the order asked;
    a field not on the image shows ``-`` (dim)."""
    table = Table("field", "value", show_lines=False)
    for name, value in fields.items():
        table.add_row(Text(safe_text(name)), Text("-", style="dim") if value is None else Text(safe_text(value)))
    return table


def renderables(res) -> list[RenderableType]:
    """What ``ocrstream submit`` prints for one finished ok result (a
    :class:`~schemas.events.ResultDocument` or anything with its task slots).

    Returns:
        ``fields`` (``extract``): one two-column table; ``markdown`` (``doc_parse``, ``chart``):
        Markdown and tables; ``html`` (``table``): its tables (and any text outside them as
        Markdown); ``latex`` (``formula``) and ``translation`` (``translate``): the text as it is;
        otherwise (``ocr``) ``text``, the lines, or ``(no text)``. Every string through
        :func:`safe_text`.
    """
    if getattr(res, "fields", None) is not None:
        return [fields_table(res.fields)]
    for slot in ("markdown", "html"):
        value = getattr(res, slot, None)
        if value is not None:
            return markdown_with_tables(value) or [Text("(no text)")]
    for slot in ("latex", "translation"):
        value = getattr(res, slot, None)
        if value is not None:
            return [Text(safe_text(value))]
    return [Text(safe_text(res.text or "(no text)"))]
