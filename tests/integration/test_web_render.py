"""The web page's answer renderer (services/api/static/render.js) alone, in headless Chromium: the
exact DOM it builds for each task's answer, and that nothing the model wrote runs or loads.
Needs no stack (the page's upload path with a task: tests/integration/test_web_page.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

pytestmark = pytest.mark.stackless

CHROMIUM = Path("/usr/bin/chromium")
RENDER_JS = Path(__file__).resolve().parents[2] / "services/api/static/render.js"


@pytest.fixture(scope="module")
def page():
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} missing: run scripts/browser.sh", pytrace=False)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        pg = browser.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        requests: list[str] = []
        pg.on("request", lambda r: requests.append(r.url))
        pg.set_content("<!doctype html><html><body><div id=box></div></body></html>")
        pg.add_script_tag(content=RENDER_JS.read_text())
        pg.errors, pg.requests = errors, requests
        yield pg
        browser.close()


def render(page, doc: dict) -> tuple[str | None, str]:
    """``renderAnswer`` on ``doc``: (the slot shown, the box's innerHTML); then every element in the
    box is clicked, hovered and focused, so a handler the model smuggled in would fire."""
    slot = page.evaluate("doc => window.ocrRender.renderAnswer(document.getElementById('box'), doc)", doc)
    page.evaluate("""() => { for (const e of document.querySelectorAll('#box *')) {
        for (const t of ['click', 'mouseover', 'focus', 'load', 'error']) e.dispatchEvent(new Event(t)); } }""")
    return slot, page.inner_html("#box")


HOSTILE_TABLE = (
    "<table onmouseover=\"window.__pwned='table'\"><thead><tr><th onclick=\"window.__pwned='th'\">Item</th>"
    "<th>Price<style>body{display:none}</style></th></tr></thead>"
    "<tbody><tr><td>Pen<script>window.__pwned='cell'</script></td>"
    "<td><img src=\"http://127.0.0.1:9/x.png\" onerror=\"window.__pwned='img'\">3.00</td></tr>"
    "<tr><td colspan=\"2 onmouseover=x\"><a href=\"javascript:window.__pwned='a'\">Paid</a> &amp; <b>done</b><br>ok</td></tr>"
    "<tr><td rowspan=\"1000\"><iframe src=\"http://127.0.0.1:9/\"></iframe>x</td><td colspan=\"3\">"
    "<table><tr><td>inner</td></tr></table></td></tr></tbody></table>"
)


def test_a_models_html_table_is_rebuilt_from_the_allow_list(page):
    slot, html = render(page, {"task": "table", "html": "Before <script>window.__pwned='top'</script>\n\n"
                                                        + HOSTILE_TABLE})
    assert slot == "html"
    assert html == (
        "<p>Before &lt;script&gt;window.__pwned='top'&lt;/script&gt;</p>"
        "<table><thead><tr><th>Item</th><th>Price</th></tr></thead>"
        "<tbody><tr><td>Pen</td><td>3.00</td></tr>"
        "<tr><td colspan=\"2\">Paid &amp; done<br>ok</td></tr>"
        "<tr><td>x</td><td colspan=\"3\"><table><tbody><tr><td>inner</td></tr></tbody></table></td></tr></tbody></table>")
    assert page.evaluate("window.__pwned") is None
    assert page.requests == [] and page.errors == []


def test_markdown_is_rendered_as_its_safe_subset(page):
    md = ("# Invoice **INV-7**\n\n## Lines\n\nSold by **ACME** on `2026-12-01`,\nshipped <img src=x onerror=alert(1)>.\n\n"
          "- cash\n- `card`\n\n1. first\n2. second\n\n"
          "```mermaid\ngraph TD\nA--><b>B</b>\n```\n\n"
          "| Year | Sales |\n|---|---:|\n| 2024 | **10** |\n| 2025 | 12 |\n\n"
          "<table><tr><td>T</td></tr></table>\ntail")
    slot, html = render(page, {"task": "doc_parse", "markdown": md})
    assert slot == "markdown"
    assert html == (
        "<h4>Invoice <strong>INV-7</strong></h4><h5>Lines</h5>"
        "<p>Sold by <strong>ACME</strong> on <code>2026-12-01</code>, shipped &lt;img src=x onerror=alert(1)&gt;.</p>"
        "<ul><li>cash</li><li><code>card</code></li></ul><ol><li>first</li><li>second</li></ol>"
        "<pre><code data-lang=\"mermaid\">graph TD\nA--&gt;&lt;b&gt;B&lt;/b&gt;</code></pre>"
        "<table><thead><tr><th>Year</th><th>Sales</th></tr></thead>"
        "<tbody><tr><td>2024</td><td><strong>10</strong></td></tr><tr><td>2025</td><td>12</td></tr></tbody></table>"
        "<table><tbody><tr><td>T</td></tr></tbody></table><p>tail</p>")
    assert page.evaluate("window.__pwned") is None and page.requests == [] and page.errors == []


def test_fields_latex_and_translation(page):
    slot, html = render(page, {"task": "extract", "fields": {"invoice number": "INV-7", "<b>x</b>": "a<script>b",
                                                             "total": None}})
    assert slot == "fields"
    assert html == (
        "<table class=\"fields\"><thead><tr><th>field</th><th>value</th></tr></thead><tbody>"
        "<tr><th>invoice number</th><td>INV-7</td></tr>"
        "<tr><th>&lt;b&gt;x&lt;/b&gt;</th><td>a&lt;script&gt;b</td></tr>"
        "<tr><th>total</th><td class=\"absent\" title=\"not on the image\">—</td></tr></tbody></table>")
    assert render(page, {"task": "formula", "latex": r"\frac{a}{b} < c"}) == (
        "latex", "<pre><code>\\frac{a}{b} &lt; c</code></pre>")
    assert render(page, {"task": "translate", "translation": "Total: 3\n<i>Thanks</i>"}) == (
        "translation", "<p class=\"translation\">Total: 3\n&lt;i&gt;Thanks&lt;/i&gt;</p>")
    assert render(page, {"task": "ocr", "lines": []}) == (None, "")
    assert json.loads(page.evaluate("JSON.stringify(window.__pwned ?? null)")) is None
    assert page.requests == [] and page.errors == []


def test_tricky_markup_stays_text_and_odd_tables_still_render(page):
    html = ("<TABLE><TR><TD title=\"a>b\" onclick=\"window.__pwned='q'\">&#x3C;script&#x3E;x&lt;/script&gt; &amp;amp; &bogus;</TD>"
            "<td><!-- <script>window.__pwned='c'</script> -->c<SCRIPT>window.__pwned='S'</SCRIPT><textarea><td>t</td>"
            "</textarea></td></tr><tr><th colspan='2'>h <img src=x onerror=window.__pwned=1</th>")  # an img tag never closed: text
    slot, out = render(page, {"task": "table", "html": html})
    assert slot == "html"
    assert out == ("<table><tbody><tr><td>&lt;script&gt;x&lt;/script&gt; &amp;amp; &amp;bogus;</td><td>c</td></tr>"
                   "<tr><th colspan=\"2\">h &lt;img src=x onerror=window.__pwned=1</th></tr></tbody></table>")
    assert page.evaluate("window.__pwned") is None and page.requests == [] and page.errors == []


def test_escaped_markdown_reads_as_its_text_and_a_fenced_table_stays_code(page):
    # the CPU engine's doc_parse escapes what would read as Markdown or HTML (services/infer/engines/structure.py)
    md = ("\\# 5\n\n\\- 2.00\n\n1\\. Tea\n\n\\<table>x\\</table> a\\_b \\*x\\* \\& \\\\<b> `a\\*b` \\`c`\n\n"
          "```html\n<table><tr><td>code</td></tr></table>\n```\n\n~~~\n<table>\n~~~\n"
          "\\\\<table><tr><td>real</td></tr></table>")
    slot, html = render(page, {"task": "doc_parse", "markdown": md})
    assert slot == "markdown"
    assert html == (
        "<p># 5</p><p>- 2.00</p><p>1. Tea</p><p>&lt;table&gt;x&lt;/table&gt; a_b *x* &amp; \\&lt;b&gt; "
        "<code>a\\*b</code> `c`</p>"
        "<pre><code data-lang=\"html\">&lt;table&gt;&lt;tr&gt;&lt;td&gt;code&lt;/td&gt;&lt;/tr&gt;&lt;/table&gt;</code></pre>"
        "<pre><code>&lt;table&gt;</code></pre><p>\\</p>"
        "<table><tbody><tr><td>real</td></tr></tbody></table>")
    assert page.evaluate("window.__pwned") is None and page.requests == [] and page.errors == []


def test_a_table_of_unclosed_tags_is_read_in_linear_time(page):
    # the tokenizer's tag pattern ran from each "<" to the end of a table holding no ">" after it:
    # 60 KB of "<a " froze the page for 3.5 s (quadratic), 120 KB for ~39 s; 120 KB of blanks in a
    # colspan 14 s; 120 KB of "<table" 2.3 s
    for html in ["<table><tr><td>" + body for body in ("<a " * 40_000, '<td title="x' + "<a " * 40_000,
                                                        "<a\"<b'" * 20_000, "<td colspan=" + " " * 120_000 + ">x")] + \
            ["<table" * 20_000]:  # finding the tables; a span attribute's number
        ms = page.evaluate("""doc => { const t = performance.now();
            window.ocrRender.renderAnswer(document.getElementById('box'), doc); return performance.now() - t; }""",
                           {"task": "table", "html": html})
        assert ms < 1500, (html[:24], ms)
    slot, html = render(page, {"task": "table", "html": "<table><tr><td>a <b c <d e</td><td title='a>b'>1 < 2</td></tr></table>"})
    assert html == "<table><tbody><tr><td>a &lt;b c &lt;d e</td><td>1 &lt; 2</td></tr></tbody></table>"
