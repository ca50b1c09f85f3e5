"""Result assembly: grouping segments into lines, full text, CER."""

from services.common.textlines import Segment, cer, group_lines, normalize_text
from schemas.events import Line
from services.sink.handler import full_text


def seg(x0, y0, x1, y1, text, conf=0.9):
    return Segment(box=[[x0, y0], [x1, y0], [x1, y1], [x0, y1]], text=text, confidence=conf)


def test_segments_on_one_row_merge_left_to_right():
    lines = group_lines([seg(400, 52, 600, 108, "4821", 1.0), seg(45, 55, 372, 108, "INVOICE", 0.5),
                         seg(43, 169, 733, 225, "TOTAL 97.50 EUR")])
    assert [l.text for l in lines] == ["INVOICE 4821", "TOTAL 97.50 EUR"]
    assert lines[0].box == [[45, 52], [600, 52], [600, 108], [45, 108]]
    assert abs(lines[0].confidence - (0.5 * 7 + 1.0 * 4) / 11) < 1e-9


def test_characters_read_twice_in_overlapping_detections_are_dropped():
    # RapidOCR on the CMYK case reads "QTY 1" and "12 PCS", the two boxes overlapping by ~28 px
    lines = group_lines([seg(41, 165, 253, 235, "QTY 1"), seg(225, 168, 509, 227, "12 PCS")])
    assert [l.text for l in lines] == ["QTY 12 PCS"]
    # no overlap: nothing dropped even if the characters repeat
    lines = group_lines([seg(0, 0, 100, 40, "AB 1"), seg(120, 0, 200, 40, "12")])
    assert [l.text for l in lines] == ["AB 1 12"]


def test_rows_that_barely_touch_stay_apart():
    lines = group_lines([seg(0, 0, 100, 40, "A"), seg(0, 35, 100, 75, "B")])
    assert [l.text for l in lines] == ["A", "B"]


def test_stacked_segments_in_one_column_do_not_merge():
    # same vertical band but overlapping horizontally = two different lines, never "A B"
    lines = group_lines([seg(0, 0, 100, 40, "A"), seg(10, 10, 90, 45, "B")])
    assert len(lines) == 2


def test_empty_text_is_dropped():
    assert group_lines([seg(0, 0, 10, 10, "  ")]) == []


def test_full_text_separates_pages():
    box = [[0, 0], [1, 0], [1, 1], [0, 1]]
    lines = [Line(text="a", box=box, confidence=1, page=1), Line(text="b", box=box, confidence=1, page=1),
             Line(text="c", box=box, confidence=1, page=2)]
    assert full_text(lines) == "a\nb\n\nc"


def test_cer():
    assert cer("abcd", "abcd") == 0.0
    assert cer("abcd", "abXd") == 0.25
    assert cer("TAN  CHAY\nYEE", "tan chay yee") == 0.0
    assert cer("", "") == 0.0 and cer("", "x") == 1.0
    assert normalize_text(" A\tB \n") == "a b"
