"""Every case of ../shared/cases through the real pipeline, each followed by a good image (issue: faults)."""

from __future__ import annotations

from schemas.errors import ErrorCode
from services.infer.textlines import cer
from tests.conftest import CASES, text_image

# Our documented choice for the cases that allow either reading or rejecting.
REJECT_CODES = {
    "img17_truncated.jpg": ErrorCode.CORRUPT_IMAGE,
    "img19_zero_bytes.jpg": ErrorCode.EMPTY_INPUT,
    "img20_decompression_bomb.png": ErrorCode.IMAGE_TOO_LARGE,
}


def nospace_cer(expected: str, got: str) -> float:
    """CER ignoring whitespace: PP-OCRv4's recogniser often drops the spaces between words."""
    return cer("".join(expected.split()), "".join(got.split()))


def best_line_cer(expected: str, lines: list[str]) -> float:
    return min((nospace_cer(expected, got) for got in lines), default=1.0)


async def test_every_case_behaves_as_documented(pipeline, cases):
    items = []
    for i, case in enumerate(cases):
        items.append(((CASES / case["file"]).read_bytes(), case["file"]))
        items.append((text_image([f"NEXT PAGE {i:02d}"]), f"next-{i}.png"))
    docs = await pipeline.run(items, timeout=900)
    for i, case in enumerate(cases):
        doc, nxt = docs[2 * i], docs[2 * i + 1]
        assert nxt.status == "ok" and nxt.text == f"NEXT PAGE {i:02d}", (case["id"], nxt)
        name = case["file"]
        if name in REJECT_CODES:
            assert doc.status == "error" and doc.error.code is REJECT_CODES[name], (case["id"], doc.error)
            assert doc.lines == []
            continue
        assert doc.status == "ok", (case["id"], doc.error)
        texts = [line.text for line in doc.lines]
        for expected in case["expected_text"]:
            assert best_line_cer(expected, texts) <= 0.1, (case["id"], expected, texts)
        for line in doc.lines:
            page = doc.pages[line.page - 1]
            assert all(0 <= x <= page.width and 0 <= y <= page.height for x, y in line.box), (case["id"], line)
        if case["expect"] == "ocr_all_frames":
            assert len(doc.pages) == 3
            for page, expected in enumerate(case["expected_text"], start=1):
                assert best_line_cer(expected, [l.text for l in doc.lines if l.page == page]) <= 0.1, (page, expected)
        if name == "img15_animated.gif":
            assert len(doc.pages) == 2
            assert best_line_cer("FRAME TWO 222", [l.text for l in doc.lines if l.page == 2]) <= 0.1
        if name == "img22_long_receipt_600x12000.png":
            assert len(doc.lines) == 80
            assert [nospace_cer(e, g) <= 0.1 for e, g in zip(case["expected_text"], texts)] == [True] * 80
        if name == "img02_exif_orientation6.jpg":
            assert (doc.width, doc.height) == (3000, 4000)
        if name == "img25_one_pixel.png":
            assert doc.lines == []
