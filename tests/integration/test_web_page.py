"""The web page at ``/`` in headless Chromium (Debian's, installed by scripts/browser.sh): real
uploads through the real door and pipeline, text shown, JSON download, boxes found in a screenshot."""

from __future__ import annotations

import concurrent.futures
import io
import json
import re
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import Page, expect, sync_playwright

from tests.conftest import text_image
from tests.integration.conftest import API_MAX_BYTES

pytestmark = pytest.mark.stack

CHROMIUM = Path("/usr/bin/chromium")
DONE_MS = 120_000  # how long a card may take to finish (the pipeline's first image loads the engine)


@pytest.fixture(scope="module")
def browser():
    """Headless Debian chromium driven by Playwright (no browser download)."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} missing: run scripts/browser.sh", pytrace=False)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield b
        b.close()


class Tab:
    """One page on the door's ``/`` with everything it asked for and every script error."""

    def __init__(self, page: Page, origin: str):
        self.page = page
        self.requests: list = []
        self.errors: list[str] = []
        page.on("request", lambda r: self.requests.append(r))
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.origin = origin

    def off_origin(self) -> list[str]:
        return [r.url for r in self.requests if not r.url.startswith((self.origin + "/", "blob:", "data:"))]

    def upload(self, path: Path):
        """Choose ``path`` in the file picker; the newest card (the page prepends it)."""
        self.page.set_input_files("#files", str(path))
        card = self.page.locator(".card").first
        expect(card.locator(".name")).to_have_text(path.name)
        return card


@pytest.fixture
def tab(browser, api):
    ctx = browser.new_context(viewport={"width": 1280, "height": 900}, device_scale_factor=1, accept_downloads=True)
    page = ctx.new_page()
    t = Tab(page, api.url)
    page.goto(api.url + "/")
    yield t
    ctx.close()


def _pixels(locator, path: Path, doc: dict) -> tuple[np.ndarray, float, float, float]:
    """Screenshot of the canvas as an int array, plus (border px, screen px per page px in x, in y):
    the scale comes from the canvas's size on screen and the document's page size, not from the page."""
    locator.screenshot(path=str(path))
    arr = np.asarray(Image.open(path).convert("RGB")).astype(int)
    border, client_w, client_h = locator.evaluate("c => [c.clientLeft, c.clientWidth, c.clientHeight]")
    return arr, border, client_w / doc["width"], client_h / doc["height"]


def _mask(arr: np.ndarray, rgb: tuple[int, int, int]) -> np.ndarray:
    """Pixels near a saturated colour (a blend with white or black from scaling stays close on the
    saturated channels): magenta/cyan never occur in a black-on-white image."""
    r, g, b = arr[..., 0], arr[..., 1], arr[..., 2]
    hi = lambda c: c > 180  # noqa: E731
    lo = lambda c: c < 110  # noqa: E731
    chans = [r, g, b]
    return np.logical_and.reduce([hi(c) if v == 255 else lo(c) for c, v in zip(chans, rgb)])


def _edge_midpoints(box, border, kx, ky) -> list[tuple[int, int]]:
    pts = [(border + x * kx, border + y * ky) for x, y in box]
    return [(round((pts[i][0] + pts[(i + 1) % 4][0]) / 2), round((pts[i][1] + pts[(i + 1) % 4][1]) / 2))
            for i in range(4)]


def _hits_near(mask: np.ndarray, x: int, y: int, r: int = 4) -> int:
    return int(mask[max(0, y - r): y + r + 1, max(0, x - r): x + r + 1].sum())


def _outside(shape, boxes, border, kx, ky, margin: float) -> np.ndarray:
    """True where a pixel is farther than ``margin`` screen px from every box's bounding rectangle."""
    out = np.ones(shape[:2], dtype=bool)
    for box in boxes:
        xs = [border + x * kx for x, _ in box]
        ys = [border + y * ky for _, y in box]
        x0, x1 = int(max(0, min(xs) - margin)), int(max(xs) + margin) + 1
        y0, y1 = int(max(0, min(ys) - margin)), int(max(ys) + margin) + 1
        out[y0:y1, x0:x1] = False
    return out


def test_upload_shows_the_text_draws_every_box_and_offers_the_json(tab, tmp_path):
    expected = ["WEB PAGE 42", "BOXES DRAWN"]
    img = tmp_path / "web-page.png"
    img.write_bytes(text_image(expected, size=40))
    page = tab.page
    expect(page.get_by_label("Choose files…")).to_be_attached()
    card = tab.upload(img)
    expect(card).to_have_attribute("data-state", "done", timeout=DONE_MS)
    expect(card.locator(".state")).to_have_text("done")

    # the text, exactly, one list item per line
    assert card.locator(".lines li").all_inner_texts() == expected
    assert "\n".join(card.locator(".lines li").all_inner_texts()) == "\n".join(expected)
    expect(card.locator(".ms")).to_have_text(re.compile(r"^\d+ ms$"))

    # the download is the result document
    with page.expect_download() as dl:
        card.locator("a.download").click()
    assert dl.value.suggested_filename == "web-page.ocr.json"
    doc = json.loads(Path(dl.value.path()).read_text())
    assert doc["request_id"] == card.get_attribute("data-request-id") and doc["request_id"]
    assert doc["status"] == "ok" and doc["text"] == "\n".join(expected)
    assert [ln["text"] for ln in doc["lines"]] == expected
    assert all(len(ln["box"]) == 4 for ln in doc["lines"])
    assert card.locator(".cache").is_hidden() is not doc["cache_hit"]

    # the boxes, in the screenshot of the canvas, where the document says they are
    canvas = card.locator("canvas")
    expect(canvas).to_have_attribute("data-drawn", "true")
    assert canvas.get_attribute("aria-label") == "web-page.png with 2 text line boxes"
    page.mouse.move(0, 0)
    arr, border, kx, ky = _pixels(canvas, tmp_path / "canvas.png", doc)
    boxes = [ln["box"] for ln in doc["lines"]]
    magenta = _mask(arr, (255, 0, 255))
    assert magenta.sum() > 0
    for box in boxes:
        for x, y in _edge_midpoints(box, border, kx, ky):
            assert _hits_near(magenta, x, y) > 0, f"no box stroke at ({x}, {y}) of {box}; see {tmp_path}"
    far = _outside(arr.shape, boxes, border, kx, ky, margin=6 + 4 * max(kx, ky))
    assert far.sum() > arr.shape[0] * arr.shape[1] // 4  # there is room far from the boxes ...
    assert int((magenta & far).sum()) == 0  # ... and nothing is drawn there
    # the image is drawn under them, aligned: the glyphs are inside the boxes
    dark = (arr < 100).all(axis=2)
    for box in boxes:
        assert int((dark & ~_outside(arr.shape, [box], border, kx, ky, margin=0)).sum()) > 50
    near_boxes = ~_outside(arr.shape, boxes, border, kx, ky, margin=4)
    assert int((dark & near_boxes).sum()) >= 0.98 * int(dark.sum())

    # pointing at a line highlights its box, and only its box
    card.locator('.lines li[data-index="1"]').hover()
    arr, border, kx, ky = _pixels(canvas, tmp_path / "canvas-hover.png", doc)
    cyan = _mask(arr, (0, 255, 255))
    assert all(_hits_near(cyan, x, y) > 0 for x, y in _edge_midpoints(boxes[1], border, kx, ky))
    assert all(_hits_near(cyan, x, y) == 0 for x, y in _edge_midpoints(boxes[0], border, kx, ky))

    page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
    assert tab.off_origin() == [] and tab.errors == []


def test_a_bad_file_shows_its_error_code_and_the_next_file_still_works(tab, tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("just some words, not an image\n")
    card = tab.upload(bad)
    expect(card).to_have_attribute("data-state", "error", timeout=DONE_MS)
    expect(card.locator(".error .code")).to_have_text("unsupported_format")
    assert card.locator(".error .message").inner_text().strip()
    assert card.locator(".body").is_hidden() and card.locator("a.download").is_hidden()

    good = tmp_path / "after-bad.png"
    good.write_bytes(text_image(["AFTER BAD 55"], size=40))
    card = tab.upload(good)
    expect(card).to_have_attribute("data-state", "done", timeout=DONE_MS)
    assert card.locator(".lines li").all_inner_texts() == ["AFTER BAD 55"]
    first_id = card.get_attribute("data-request-id")

    # the same image again: answered from the cache, badge shown; a narrow window does not overflow
    tab.page.set_viewport_size({"width": 380, "height": 800})
    again = tmp_path / "after-bad-again.png"
    again.write_bytes(good.read_bytes())
    card = tab.upload(again)
    expect(card).to_have_attribute("data-state", "done", timeout=DONE_MS)
    expect(card.locator(".cache")).to_be_visible()
    assert card.locator(".lines li").all_inner_texts() == ["AFTER BAD 55"]
    assert card.get_attribute("data-request-id") != first_id
    assert tab.page.evaluate("document.documentElement.scrollWidth") <= 380
    box = card.locator("canvas").bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 380

    assert len(tab.page.locator(".card").all()) == 3
    tab.page.screenshot(path=str(tmp_path / "page-narrow.png"), full_page=True)
    assert tab.off_origin() == []
    assert [e for e in tab.errors if "415" not in e] == []  # the browser logs the failed POST itself


def test_an_api_key_is_kept_in_the_browser_and_sent_as_x_api_key(tab, tmp_path):
    page = tab.page
    page.locator("#key-box summary").click()
    page.get_by_label("API key (kept in this browser, sent as X-API-Key)").fill("web-test-key")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#key-state")).to_have_text("saved")
    page.reload()
    assert page.evaluate("localStorage.getItem('ocrstream.apiKey')") == "web-test-key"
    assert page.locator("#api-key").input_value() == "web-test-key"

    img = tmp_path / "keyed.png"
    img.write_bytes(text_image(["KEYED UPLOAD"], size=40))
    with page.expect_request(lambda r: r.method == "POST" and "/v1/ocr" in r.url) as req:
        card = tab.upload(img)
    assert req.value.headers.get("x-api-key") == "web-test-key"
    assert req.value.headers.get("content-type") == "image/png"
    expect(card).to_have_attribute("data-state", "done", timeout=DONE_MS)

    page.locator("#key-box summary").click()
    page.get_by_role("button", name="Forget").click()
    expect(page.locator("#key-state")).to_have_text("cleared")
    assert page.evaluate("localStorage.getItem('ocrstream.apiKey')") is None


def _exif_rotated_jpeg(upright: bytes) -> bytes:
    """``upright`` stored turned a quarter left with EXIF Orientation 6 (viewers turn it back right)."""
    img = Image.open(io.BytesIO(upright)).convert("RGB").rotate(90, expand=True)
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=95, exif=exif)
    return buf.getvalue()


def test_an_exif_rotated_large_photo_is_drawn_upright_scaled_down_with_its_boxes_on_the_glyphs(tab, tmp_path):
    expected = ["TURNED PAGE 8"]
    upright = text_image(expected, size=64, width=2400)  # over the page's 2000 px canvas cap
    photo = tmp_path / "turned.jpg"
    photo.write_bytes(_exif_rotated_jpeg(upright))
    card = tab.upload(photo)
    expect(card).to_have_attribute("data-state", "done", timeout=DONE_MS)
    assert card.locator(".lines li").all_inner_texts() == expected
    with tab.page.expect_download() as dl:
        card.locator("a.download").click()
    doc = json.loads(Path(dl.value.path()).read_text())
    up_w, up_h = Image.open(io.BytesIO(upright)).size
    assert (doc["width"], doc["height"]) == (up_w, up_h)  # the upright page, not the stored pixels

    canvas = card.locator("canvas")
    cw, ch = canvas.evaluate("c => [c.width, c.height]")
    assert cw == 2000 and abs(ch - up_h * 2000 / up_w) <= 1  # drawn upright, scaled down
    tab.page.mouse.move(0, 0)
    arr, border, kx, ky = _pixels(canvas, tmp_path / "canvas.png", doc)
    assert kx < 0.8 and abs(kx - ky) < 0.01  # scaled to fit the card, aspect kept
    [box] = [ln["box"] for ln in doc["lines"]]
    magenta = _mask(arr, (255, 0, 255))
    assert all(_hits_near(magenta, x, y) > 0 for x, y in _edge_midpoints(box, border, kx, ky))
    assert int((magenta & _outside(arr.shape, [box], border, kx, ky, margin=8)).sum()) == 0
    dark = (arr < 100).all(axis=2)
    near_box = ~_outside(arr.shape, [box], border, kx, ky, margin=4)
    assert int(dark.sum()) > 100 and int((dark & near_box).sum()) >= 0.98 * int(dark.sum())
    assert tab.errors == []


def test_a_pdf_the_browser_cannot_draw_lists_the_text_of_every_page_with_a_note(tab, tmp_path):
    pages = [Image.open(io.BytesIO(text_image([t], size=40))).convert("RGB") for t in ("KEY SENT 31", "BOXES DRAWN")]
    pdf = tmp_path / "two-pages.pdf"
    pages[0].save(pdf, "PDF", save_all=True, append_images=pages[1:], resolution=72)
    card = tab.upload(pdf)
    expect(card).to_have_attribute("data-state", "done", timeout=DONE_MS)
    items = card.locator(".lines li")
    assert items.all_inner_texts() == ["KEY SENT 31", "BOXES DRAWN"]
    assert [items.nth(i).get_attribute("data-page") for i in range(2)] == ["1", "2"]
    expect(card.locator("canvas")).to_be_hidden()
    expect(card.locator(".note")).to_have_text(
        "This browser cannot draw application/pdf; the text of 2 pages is listed instead.")
    assert tab.errors == []


def test_a_file_over_the_byte_limit_shows_input_too_large(tab, tmp_path):
    big = tmp_path / "huge.png"
    big.write_bytes(b"\x89PNG\r\n\x1a\n" + np.random.default_rng(8).bytes(API_MAX_BYTES + 200_000))
    card = tab.upload(big)
    expect(card).to_have_attribute("data-state", "error", timeout=DONE_MS)
    expect(card.locator(".error .code")).to_have_text("input_too_large")
    assert card.locator(".body").is_hidden()


def _submits(url: str) -> bool:
    """Whether ``url`` is the page's ``POST v1/ocr`` (its polls are ``v1/ocr/{id}?wait=``)."""
    return "/v1/ocr?" in url


def test_a_lost_upload_answer_is_retried_with_the_same_request_id_and_the_image_is_sent_once(tab, tmp_path):
    """The first POST reaches the real door, which accepts it, but its answer is cut off on the way
    back (as a dropped connection would): the page retries with the same client-chosen
    ``request_id``, the door answers that request's state, and the image is on ``ocr.requests`` once."""
    from tests.integration.test_http import _requests_with_id

    posts: list[str] = []

    def drop_first_answer(route):
        posts.append(route.request.url)
        if len(posts) == 1:
            assert route.fetch().status == 202  # the door took the upload ...
            route.abort("connectionreset")  # ... and the page never hears of it
        else:
            route.continue_()

    tab.page.route(_submits, drop_first_answer)
    img = tmp_path / "lost-answer.png"
    img.write_bytes(text_image(["LOST ANSWER 4242"], size=40))
    card = tab.upload(img)
    expect(card).to_have_attribute("data-state", "done", timeout=DONE_MS)
    assert card.locator(".lines li").all_inner_texts() == ["LOST ANSWER 4242"]
    ids = [parse_qs(urlparse(u).query)["request_id"] for u in posts]
    assert len(posts) == 2 and ids[0] == ids[1] and len(ids[0]) == 1, posts
    rid = ids[0][0]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", rid), rid  # randomUUID
    assert card.get_attribute("data-request-id") == rid
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # Playwright's sync API holds this thread's loop
        assert pool.submit(_requests_with_id, rid).result() == 1
    assert [e for e in tab.errors if "ERR_CONNECTION_RESET" not in e] == []


def test_without_random_uuid_the_page_still_sends_a_random_request_id(tab, tmp_path):
    """crypto.randomUUID exists in secure contexts only (https, localhost); elsewhere the page makes
    its id from crypto.getRandomValues."""
    tab.page.add_init_script("delete Crypto.prototype.randomUUID")
    tab.page.reload()
    assert tab.page.evaluate("typeof crypto.randomUUID") == "undefined"
    img = tmp_path / "no-uuid.png"
    img.write_bytes(text_image(["NO UUID 1717"], size=40))
    with tab.page.expect_request(lambda r: r.method == "POST" and _submits(r.url)) as req:
        card = tab.upload(img)
    [rid] = parse_qs(urlparse(req.value.url).query)["request_id"]
    assert re.fullmatch(r"web-[0-9a-f]{32}", rid), rid
    expect(card).to_have_attribute("data-state", "done", timeout=DONE_MS)
    assert card.get_attribute("data-request-id") == rid
    assert tab.errors == []


@pytest.mark.parametrize("code, retry_after, message", [
    ("quota_exceeded", "30", "the key's daily quota is used up"),  # never retried: waiting does not refill it soon
    ("rate_limited", "3600", "the key's rate limit is used up (retry after 3600 s)"),  # over the 60 s cap
])
def test_a_429_that_waiting_will_not_fix_soon_is_shown_at_once(tab, tmp_path, code, retry_after, message):
    """The page does not sleep out an hour's Retry-After nor retry a used-up quota: the card shows
    the error after the one POST. (The 429 answer is made up by the browser's router: a real one
    needs a day's quota used up.)"""
    posts: list[str] = []

    def refuse(route):
        posts.append(route.request.url)
        route.fulfill(status=429, headers={"Retry-After": retry_after}, content_type="application/json",
                      body=json.dumps({"error": {"code": code, "message": message.split(" (")[0]}}))

    tab.page.route(_submits, refuse)
    img = tmp_path / f"{code}.png"
    img.write_bytes(text_image(["NOT SENT"], size=40))
    card = tab.upload(img)
    expect(card).to_have_attribute("data-state", "error", timeout=10_000)
    expect(card.locator(".error .code")).to_have_text(code)
    expect(card.locator(".error .message")).to_have_text(message)
    assert len(posts) == 1


# A doc_parse answer in HunyuanOCR's format (Markdown, the table as HTML) with hostile bits a model
# could be made to write by the image: a script, an event handler, a link and markup outside the table.
HOSTILE_MARKDOWN = (
    "# Invoice INV-7\n\nSold by **ACME** <script>window.__pwned = 'md'</script>\n\n"
    "<table><thead><tr><th>Item</th><th onclick=\"window.__pwned='th'\">Price</th></tr></thead>"
    "<tbody><tr><td>Pen<script>window.__pwned = 'cell'</script></td><td><img src=x onerror=\"window.__pwned='img'\">3.00</td></tr>"
    "<tr><td colspan=\"2\"><a href=\"javascript:window.__pwned='a'\">Paid</a> &amp; done</td></tr></tbody></table>\n\n"
    "- cash\n- `card`\n"
)


def _answer(route, task: str, **slots) -> None:
    """Answer the page's long-poll with a finished result document of ``task`` for its request id."""
    from schemas.events import ResultDocument
    from schemas.tasks import TaskParams

    rid = urlparse(route.request.url).path.rsplit("/", 1)[-1]
    params = TaskParams(fields=tuple(slots["fields"])) if task == "extract" else None
    doc = ResultDocument(request_id=rid, status="ok", content_sha256="0" * 64, task=task, task_params=params,
                         text=slots.get("markdown") or json.dumps(slots.get("fields")), width=320, height=120, **slots)
    body = {"request_id": rid, "status": "ok", "result": doc.model_dump(mode="json", by_alias=True),
            "links": {"self": f"v1/ocr/{rid}", "wait": f"v1/ocr/{rid}?wait=30"}}
    route.fulfill(status=200, content_type="application/json", body=json.dumps(body))


def _tasks_url(url: str) -> bool:
    return urlparse(url).path == "/v1/tasks"


def _vlm_tasks() -> str:
    """``GET v1/tasks`` as a door configured for the ``openai`` engine answers it (every task runs)."""
    from services.api.protocol import deployment_tasks
    from services.common.cache.keys import CacheKeySettings

    return deployment_tasks(CacheKeySettings(engine_kind="openai")).model_dump_json()


VLM_TASKS = _vlm_tasks()


def _accepted(route) -> None:
    """Answer the page's upload 202 pending, as a door that took it does."""
    [rid] = parse_qs(urlparse(route.request.url).query)["request_id"]
    route.fulfill(status=202, content_type="application/json", body=json.dumps(
        {"request_id": rid, "status": "pending", "cache_hit": False, "result": None, "error": None,
         "links": {"self": f"/v1/ocr/{rid}", "wait": f"/v1/ocr/{rid}?wait=60"}}))


def test_the_task_menu_offers_only_the_tasks_this_deployment_runs(tab, api):
    """The page reads the real door's ``GET v1/tasks``: on this session's CPU engine ``formula``,
    ``chart``, ``extract`` and ``translate`` are greyed out (disabled), each with the reason the door
    refuses it with, in the option's tooltip and in the list below the menu."""
    from schemas.tasks import unsupported_task_message

    page = tab.page
    off = ["formula", "chart", "extract", "translate"]
    expect(page.locator("#task option[value=extract]")).to_be_disabled()
    for name in ["ocr", "doc_parse", "table"]:
        option = page.locator(f"#task option[value={name}]")
        expect(option).to_be_enabled()
        assert option.get_attribute("title") == "" and not option.inner_text().endswith("(not here)")
    for name in off:
        option = page.locator(f"#task option[value={name}]")
        expect(option).to_be_disabled()
        assert option.get_attribute("title") == unsupported_task_message(name, "rapidocr")
        assert option.inner_text().endswith(" (not here)")
    assert page.locator("#task").input_value() == "ocr" and page.locator("#task").get_attribute("data-engine") == "rapidocr"
    box = page.locator("#tasks-off")
    expect(box).to_be_visible()
    box.locator("summary").click()
    items = box.locator("li")
    assert [items.nth(i).get_attribute("data-task") for i in range(items.count())] == off
    assert items.all_inner_texts() == [f"{n}: {unsupported_task_message(n, 'rapidocr')}" for n in off]
    # the reason shown is what the door answers a submission of it with
    r = httpx.post(f"{api.url}/v1/ocr", params={"task": "extract", "fields": "total"}, content=text_image(["X"]),
                   headers={"Content-Type": "image/png"}, timeout=30)
    assert (r.status_code, r.json()) == (422, {"error": {"code": "unsupported_task",
                                                         "message": unsupported_task_message("extract", "rapidocr")}})
    assert tab.off_origin() == [] and tab.errors == []


def test_a_task_result_shows_its_tables_and_fields_beside_the_image_and_never_runs_the_models_html(tab, tmp_path):
    """The page sends the task chosen to the real door (its query string) and shows the answer beside
    the image: Markdown as headings, lists and tables, fields as a two-column table. The answers come
    from the browser's router (this session's pipeline runs the CPU engine, whose ``doc_parse`` finds
    no table on a line of text; the answers' formats are tested on the real pipeline in
    tests/integration/test_tasks.py): what is under test is the page's rendering of them, with a
    script, an event handler and a ``javascript:`` link in the model's output that must be neither
    inserted nor run. ``extract`` the CPU engine cannot do: the door refuses it (422) and the page
    greys it out (:func:`test_the_task_menu_offers_only_the_tasks_this_deployment_runs`), so for it the
    router also plays a VLM deployment's ``GET v1/tasks`` and its 202."""
    page = tab.page
    polls = lambda url: "/v1/ocr/" in url and "wait=" in url  # noqa: E731
    page.route(polls, lambda route: _answer(route, "doc_parse", markdown=HOSTILE_MARKDOWN))
    page.select_option("#task", "doc_parse")
    img = tmp_path / "task-doc.png"
    img.write_bytes(text_image(["INVOICE INV-7"], size=40))
    with page.expect_request(lambda r: r.method == "POST" and _submits(r.url)) as req:
        card = tab.upload(img)
    assert parse_qs(urlparse(req.value.url).query)["task"] == ["doc_parse"]
    expect(card).to_have_attribute("data-state", "done", timeout=DONE_MS)
    answer = card.locator(".answer")
    expect(answer).to_be_visible()
    assert answer.get_attribute("data-slot") == "markdown" and card.get_attribute("data-task") == "doc_parse"
    assert card.locator(".lines").is_hidden()
    assert answer.locator("h4").all_inner_texts() == ["Invoice INV-7"]
    assert answer.locator("p strong").all_inner_texts() == ["ACME"]
    assert answer.locator("thead th").all_inner_texts() == ["Item", "Price"]
    rows = answer.locator("tbody tr")
    assert [rows.nth(i).locator("td").all_inner_texts() for i in range(rows.count())] == [["Pen", "3.00"], ["Paid & done"]]
    assert answer.locator("td[colspan='2']").count() == 1
    assert answer.locator("ul li").all_inner_texts() == ["cash", "card"] and answer.locator("li code").count() == 1
    # the model's markup outside the table is text; nothing it wrote became an element that runs or loads
    assert "<script>window.__pwned = 'md'</script>" in answer.locator("p").first.inner_text()
    assert card.locator("script, img, iframe, [onclick], [onerror], [onmouseover]").count() == 0
    assert answer.locator("a, [href], [src], [style]").count() == 0  # the card's own link is Download JSON
    answer.locator("thead th").nth(1).click()
    assert page.evaluate("window.__pwned") is None
    expect(card.locator("canvas")).to_have_attribute("data-drawn", "true")
    assert card.locator("canvas").get_attribute("aria-label") == "task-doc.png, doc_parse"
    view, beside = card.locator(".view").bounding_box(), answer.bounding_box()
    assert beside["x"] >= view["x"] + view["width"] and beside["y"] < view["y"] + view["height"]  # beside the image

    page.unroute(polls)
    fields = {"invoice number": "INV-7", "date": "2026-12-01", "total": None}
    page.route(polls, lambda route: _answer(route, "extract", fields=fields))
    page.route(_tasks_url, lambda route: route.fulfill(status=200, content_type="application/json", body=VLM_TASKS))
    page.route(_submits, _accepted)
    page.reload()
    expect(page.locator("#task option[value=extract]")).to_be_enabled()
    page.select_option("#task", "extract")
    page.get_by_label("Fields (comma-separated)").fill("invoice number,date,total")
    img = tmp_path / "task-fields.png"
    img.write_bytes(text_image(["INVOICE INV-8"], size=40))
    with page.expect_request(lambda r: r.method == "POST" and _submits(r.url)) as req:
        card = tab.upload(img)
    query = parse_qs(urlparse(req.value.url).query)
    assert (query["task"], query["fields"]) == (["extract"], ["invoice number,date,total"])
    expect(card).to_have_attribute("data-state", "done", timeout=DONE_MS)
    table = card.locator(".answer table.fields")
    assert table.locator("thead th").all_inner_texts() == ["field", "value"]
    rows = table.locator("tbody tr")
    assert [rows.nth(i).locator("th, td").all_inner_texts() for i in range(rows.count())] == [
        ["invoice number", "INV-7"], ["date", "2026-12-01"], ["total", "—"]]
    assert table.locator("td.absent").count() == 1
    assert tab.off_origin() == [] and tab.errors == []
