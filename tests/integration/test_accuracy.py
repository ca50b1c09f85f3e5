"""Every kind of page read at least as well as the raw engine, through the real pipeline:
light text on transparent backgrounds, independent columns, dropped spaces, a
6000x160 banner; and every file of a folder submitted by the CLI."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from PIL import Image

from schemas.errors import ErrorCode
from services.infer.textlines import normalize_text
from tests.conftest import REPO, text_image
from tests.pages import all_pages


async def test_generated_pages_are_read_with_their_exact_lines(pipeline):
    pages = all_pages()
    docs = await pipeline.run([(p.data, p.name) for p in pages], timeout=600)
    for page, doc in zip(pages, docs):
        assert doc.status == "ok", (page.name, doc.error)
        assert [normalize_text(l.text) for l in doc.lines] == [normalize_text(t) for t in page.lines], page.name
        # light text on a transparent ground went onto black, and the result says so
        assert doc.pages[0].alpha_background == ("black" if page.kind == "alpha" else None), page.name
        for line in doc.lines:
            assert line.segments, (page.name, line)
            for seg in line.segments:
                assert all(0 <= x <= doc.width and 0 <= y <= doc.height for x, y in seg.box), (page.name, seg)
                assert normalize_text(seg.text) in normalize_text(line.text), (page.name, seg.text, line.text)
    # the columns were not merged: every line of the two-column form is one segment of one column
    [form] = [d for p, d in zip(pages, docs) if p.kind == "columns"]
    assert all(len(line.segments) == 1 for line in form.lines)
    assert max(l.box[1][0] for l in form.lines[:6]) < min(l.box[0][0] for l in form.lines[6:])


async def test_dark_text_on_transparency_still_goes_onto_white(pipeline):
    grey = Image.open(io.BytesIO(text_image(["STAMP 9001"]))).convert("L")
    img = Image.new("RGBA", grey.size, (0, 0, 0, 0))
    img.putalpha(grey.point(lambda v: 255 - v))  # black text, its ground fully transparent
    buf = io.BytesIO()
    img.save(buf, "PNG")
    [doc] = await pipeline.run([(buf.getvalue(), "dark-on-transparent.png")])
    assert doc.status == "ok" and doc.text == "STAMP 9001"
    assert doc.pages[0].alpha_background == "white"


def test_a_folder_with_an_odd_extension_and_a_non_image_gets_one_result_per_file(pipeline, tmp_path):
    folder, out = tmp_path / "scans", tmp_path / "results"
    folder.mkdir()
    jpeg = io.BytesIO()
    Image.open(io.BytesIO(text_image(["HEIC NAMED 4711"]))).convert("RGB").save(jpeg, "JPEG", quality=95)
    files = {
        "phone.heic": jpeg.getvalue(),  # a JPEG under a name the old suffix list skipped
        "scan_without_extension": text_image(["NO EXTENSION 2024"]),
        "page.png": text_image(["PLAIN PNG 3344"]),
        "notes.txt": b"meeting notes, not an image\n" * 10,
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")  # hidden: skipped
    res = subprocess.run([sys.executable, "-m", "services.cli", "submit", str(folder), "--out", str(out), "--quiet",
                          "--timeout", "300"], cwd=REPO, env=dict(os.environ), capture_output=True, text=True,
                         timeout=400)
    assert res.returncode == 1, res.stdout + res.stderr  # one of them failed: notes.txt
    assert "4/4 completed, 1 failed or missing" in res.stdout, res.stdout + res.stderr
    results = {p.name.split(".")[0]: json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(results) == sorted(n.split(".")[0] for n in files)
    assert results["notes"]["status"] == "error"
    assert results["notes"]["error"]["code"] == ErrorCode.UNSUPPORTED_FORMAT.value
    texts = {k: v["text"] for k, v in results.items() if k != "notes"}
    assert texts == {"phone": "HEIC NAMED 4711", "scan_without_extension": "NO EXTENSION 2024",
                     "page": "PLAIN PNG 3344"}
    assert all(v["status"] == "ok" for k, v in results.items() if k != "notes")
