"""How ``ocrstream submit`` shows each task's result (services/cli/render.py): Markdown rendered,
HTML tables as tables, fields as a two-column table; the rich output captured as plain text."""

from __future__ import annotations

import io

from rich.console import Console
from rich.markdown import Markdown
from rich.table import Table

from schemas.events import ResultDocument
from schemas.tasks import TaskParams
from services.cli.render import HtmlTable, parse_tables, renderables, safe_text

# HunyuanOCR's doc_parse format: Markdown with the tables as HTML
PAGE = ("# Invoice INV-7\n\nSold by **ACME** <script>alert(1)</script>\n\n"
        "<table><thead><tr><th>Item</th><th>Price</th></tr></thead>"
        "<tbody><tr><td>Pen</td><td>3.00</td></tr><tr><td colspan=\"2\">Paid &amp; done</td></tr></tbody></table>\n\n"
        "- cash\n- card\n")


def _doc(task: str, **slots) -> ResultDocument:
    params = {"extract": TaskParams(fields=tuple(slots.get("fields") or ())), "translate": TaskParams(target_lang="en")}
    return ResultDocument(request_id="r1", status="ok", content_sha256="0" * 64, task=task,
                          task_params=params.get(task), text=slots.pop("text", ""), **slots)


def _printed(parts, width: int = 48) -> list[str]:
    con = Console(record=True, width=width, color_system=None, file=io.StringIO())
    for part in parts:
        con.print(part, highlight=False, markup=False)
    return [ln.rstrip() for ln in con.export_text().splitlines()]


def _cells(table: Table) -> list[list[str]]:
    cols = [[str(c) for c in col._cells] for col in table.columns]
    return [list(row) for row in zip(*cols)]


def test_doc_parse_markdown_is_rendered_with_its_html_table_as_a_table():
    parts = renderables(_doc("doc_parse", markdown=PAGE, text=PAGE))
    assert [type(p) for p in parts] == [Markdown, Table, Markdown]
    table = parts[1]
    assert [str(c.header) for c in table.columns] == ["Item", "Price"]
    assert _cells(table) == [["Pen", "3.00"], ["Paid & done", ""]]
    assert _printed(parts) == [
        "                 Invoice INV-7",
        "",
        "Sold by ACME alert(1)",  # rich's Markdown drops raw HTML tags; nothing is run in a terminal
        "┏━━━━━━━━━━━━━┳━━━━━━━┓",
        "┃ Item        ┃ Price ┃",
        "┡━━━━━━━━━━━━━╇━━━━━━━┩",
        "│ Pen         │ 3.00  │",
        "├─────────────┼───────┤",
        "│ Paid & done │       │",
        "└─────────────┴───────┘",
        "",
        " • cash",
        " • card",
    ]


def test_extract_fields_are_a_two_column_table_in_the_order_asked_with_a_dash_where_absent():
    fields = {"invoice number": "INV-7", "date": "2026-12-01", "total": None, "[b]markup[/b]": "x"}
    [table] = renderables(_doc("extract", fields=fields))
    assert [str(c.header) for c in table.columns] == ["field", "value"]
    assert _cells(table) == [["invoice number", "INV-7"], ["date", "2026-12-01"], ["total", "-"], ["[b]markup[/b]", "x"]]
    assert _printed([table]) == [
        "┏━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━┓",
        "┃ field          ┃ value      ┃",
        "┡━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━┩",
        "│ invoice number │ INV-7      │",
        "│ date           │ 2026-12-01 │",
        "│ total          │ -          │",
        "│ [b]markup[/b]  │ x          │",
        "└────────────────┴────────────┘",
    ]


def test_table_html_with_spans_becomes_a_grid():
    html = ("<table><tr><th>Region</th><th>Q1</th><th>Q2</th></tr>"
            "<tr><td rowspan=\"2\">North</td><td>1</td><td>2</td></tr><tr><td>3</td><td>4</td></tr>"
            "<tr><td>Total<br/>all</td><td colspan=\"2\"> 10 &lt;net&gt; </td></tr></table>")
    assert parse_tables(html) == [HtmlTable(header=[["Region", "Q1", "Q2"]],
                                            body=[["North", "1", "2"], ["", "3", "4"], ["Total\nall", "10 <net>", ""]])]
    [table] = renderables(_doc("table", html=html, text=html))
    assert _cells(table) == [["North", "1", "2"], ["", "3", "4"], ["Total\nall", "10 <net>", ""]]
    # a table without <th> has no header; an absurd span counts as 1; two tables give two
    two = parse_tables("<table><tr><td colspan=\"9999\">a</td><td>b</td></tr></table><p>x</p><table><tr><td>c</td></tr></table>")
    assert two == [HtmlTable(header=[], body=[["a", "b"]]), HtmlTable(header=[], body=[["c"]])]
    # a table in a cell: its text flattened into that cell, its rows on lines of their own
    nested = "<table><tr><td>a<table><tr><td>in</td><td>ner</td></tr><tr><td>x</td></tr></table></td><td>b</td></tr></table>"
    assert parse_tables(nested) == [HtmlTable(header=[], body=[["a\nin ner\nx", "b"]])]
    parts = renderables(_doc("doc_parse", markdown=f"before\n\n{nested}\n\nafter"))
    assert [type(p) for p in parts] == [Markdown, Table, Markdown]


def test_latex_translation_and_ocr_text_are_printed_as_they_are():
    assert _printed(renderables(_doc("formula", latex=r"\frac{a}{b} [red]x[/red]"))) == [r"\frac{a}{b} [red]x[/red]"]
    assert _printed(renderables(_doc("translate", translation="Total: 3 yuan\nThank you"))) == [
        "Total: 3 yuan", "Thank you"]
    assert _printed(renderables(_doc("ocr", text="LINE ONE\nLINE TWO"))) == ["LINE ONE", "LINE TWO"]
    assert _printed(renderables(_doc("ocr"))) == ["(no text)"]


HOSTILE = "a\x1b[2Jb\x1b]52;c;QUJD\x1b\\c\x9b31md\x00e\x7ff\r\ng\rh\ti"
SHOWN = "a␛[2Jb␛]52;c;QUJD␛\\c\ufffd31md␀e␡f\ng\nh\ti"


def _raw(parts) -> str:
    """What a terminal receives (escape sequences and all), styles off so only the content's show."""
    out = io.StringIO()
    con = Console(file=out, force_terminal=True, color_system=None, width=200, legacy_windows=False)
    for part in parts:
        con.print(part, highlight=False, markup=False)
    return out.getvalue()


def test_control_characters_of_an_answer_never_reach_the_terminal():
    # a model (or a hostile server behind the openai engine) answering with escape sequences: a
    # screen clear, an OSC 52 clipboard write, an 8-bit CSI; each is shown as a visible symbol
    assert SHOWN == safe_text(HOSTILE)
    docs = [_doc("ocr", text=HOSTILE), _doc("translate", translation=HOSTILE), _doc("formula", latex=HOSTILE),
            _doc("doc_parse", markdown=f"# {HOSTILE}\n\n{HOSTILE}\n\n<table><tr><td>{HOSTILE}</td></tr></table>"),
            _doc("table", html=f"<table><tr><th>{HOSTILE}</th></tr><tr><td>{HOSTILE}</td></tr></table>"),
            _doc("extract", fields={HOSTILE: HOSTILE, "n": None})]
    for doc in docs:
        raw = _raw(renderables(doc))
        assert not {"\x1b", "\x9b", "\x00", "\x7f", "\r"} & set(raw), (doc.task, raw)
        assert "␛[2Jb␛]52;c;QUJD" in raw, (doc.task, raw)
    assert _printed(renderables(_doc("translate", translation=HOSTILE)), width=80) == SHOWN.expandtabs(8).splitlines()


def test_an_escaped_or_fenced_table_tag_is_text_not_a_table():
    # the CPU engine's doc_parse escapes text that looks like HTML (\<table>); a code block may show HTML
    md = ("\\<table>x\\</table> a\\_b\n\n```html\n<table><tr><td>code</td></tr></table>\n```\n\n"
          "~~~~\n<table>\n~~~\n~~~~\n\n\\\\<table><tr><td>real</td></tr></table>")
    parts = renderables(_doc("doc_parse", markdown=md))
    assert [type(p) for p in parts] == [Markdown, Table]
    assert _cells(parts[1]) == [["real"]]
    assert _printed(parts[:1]) == [
        "<table>x</table> a_b", "", "", " <table><tr><td>code</td></tr></table>", "", "", "", " <table>", " ~~~", "", "",
        "\\"]  # rich pads a code block with a blank line and a column


def test_a_markdown_link_shows_where_it_goes_and_is_no_terminal_hyperlink():
    # the model's Markdown could put one address in a link's text and another behind it
    md = "Pay at [https://bank.example](https://evil.example/login) today"
    out = io.StringIO()
    con = Console(file=out, force_terminal=True, color_system="standard", width=200, legacy_windows=False)
    for part in renderables(_doc("doc_parse", markdown=md)):
        con.print(part, highlight=False, markup=False)
    assert "\x1b]8;" not in out.getvalue()  # no OSC 8 hyperlink
    assert _printed(renderables(_doc("doc_parse", markdown=md)), width=80) == [
        "Pay at https://bank.example (https://evil.example/login) today"]



def test_a_table_cut_short_is_shown_as_far_as_it_goes():
    # an answer cut at max_tokens (marked truncated_max_tokens) often ends inside its last table
    assert parse_tables("<table><tr><td>a</td><td>b</td></tr><tr><td>c") == [HtmlTable(header=[], body=[["a", "b"], ["c", ""]])]
    parts = renderables(_doc("doc_parse", markdown="text\n\n<table><tr><th>k</th></tr><tr><td>cut <table><tr><td>in"))
    assert [type(p) for p in parts] == [Markdown, Table]
    assert _cells(parts[1]) == [["cut\nin"]]  # a nested table's rows on lines of their own


def test_a_table_of_unclosed_tags_is_read_in_linear_time():
    # html.parser rescans the rest of the input at every "<" that opens no complete tag: 60 KB of
    # "<a " took 74 s to print (a looping model, or a hostile server behind the openai engine)
    import time

    started = time.perf_counter()
    assert renderables(_doc("doc_parse", markdown="<table" * 40_000))  # finding the tables
    assert time.perf_counter() - started < 2.5  # 0.4 s here; quadratic, 3.9 s at half the size (15 s)
    for body in ("<a " * 20_000, '<td title="x' + "<a " * 20_000, "<!--" + "<a " * 20_000, "</" * 30_000):
        started = time.perf_counter()
        [table] = parse_tables("<table><tr><td>" + body)
        assert time.perf_counter() - started < 2.5, body[:12]  # 0.07 s here; quadratic, 74 s
    assert parse_tables("<table><tr><td>1 < 2 <b>and</b> 3 <4</td><td title='a>b'>x</td></tr></table>") == [
        HtmlTable(header=[], body=[["1 < 2 and 3 <4", "x"]])]
    assert parse_tables("<table><tr><td>a <b c <d e</td></tr></table>") == [HtmlTable(header=[], body=[["a <b c <d e"]])]
