"""Result assembly: grouping segments into lines, full text, CER."""

import math

from services.infer.textlines import Segment, cer, group_lines, normalize_text, restore_spaces
from schemas.reading import Line
from services.common.results.build import full_text


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


def test_words_whose_boxes_touch_keep_a_letter_the_next_word_starts_with():
    # PP-OCRv6 on a printed "AFTER REFUSED 886572": the boxes share 1 px, and the R ending AFTER
    # is not the R starting REFUSED read twice (a sliver of a character, not a character)
    lines = group_lines([seg(34, 19, 189, 66, "AFTER"), seg(188, 17, 417, 67, "REFUSED"),
                         seg(411, 17, 592, 67, "886572")])
    assert [l.text for l in lines] == ["AFTER REFUSED 886572"]


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


def column(x0, x1, y0, pitch, texts, h=27):
    return [seg(x0, y0 + i * pitch, x1, y0 + i * pitch + h, t) for i, t in enumerate(texts)]


def test_independent_columns_are_read_one_after_the_other_and_never_merged():
    # the generated two-column form's layout: lines 60 px apart on the left, 90 on the right
    left = column(42, 330, 36, 60, ["L1", "L2", "L3", "L4", "L5", "L6"])
    right = column(630, 900, 36, 90, ["R1", "R2", "R3", "R4"])
    title = seg(42, 0, 900, 27, "FORM TITLE")
    lines = group_lines([title, *right, *left])
    assert [l.text for l in lines] == ["FORM TITLE", "L1", "L2", "L3", "L4", "L5", "L6", "R1", "R2", "R3", "R4"]
    assert all(len(l.parts) == 1 for l in lines)


def test_three_independent_columns_are_read_left_to_right():
    cols = [column(0, 200, 0, 60, ["A1", "A2", "A3", "A4"]), column(400, 600, 0, 90, ["B1", "B2", "B3"]),
            column(800, 1000, 20, 70, ["C1", "C2", "C3", "C4"])]
    lines = group_lines([s for col in reversed(cols) for s in col])
    assert [l.text for l in lines] == ["A1", "A2", "A3", "A4", "B1", "B2", "B3", "C1", "C2", "C3", "C4"]


def test_a_table_whose_rows_line_up_is_read_row_by_row():
    # a receipt: item names on every row, a price on every other one, far to the right
    names = column(40, 300, 100, 40, ["ITEM ONE", "  REF 11", "ITEM TWO", "  REF 22", "TOTAL"], h=30)
    prices = [seg(600, 100 + i * 40, 680, 130 + i * 40, p) for i, p in ((0, "1.00"), (2, "2.00"), (4, "3.00"))]
    lines = group_lines(names + prices)
    assert [l.text for l in lines] == ["ITEM ONE 1.00", "REF 11", "ITEM TWO 2.00", "REF 22", "TOTAL 3.00"]
    assert [p.text for p in lines[0].parts] == ["ITEM ONE", "1.00"]


def test_two_groups_of_fields_side_by_side_are_read_one_after_the_other():
    """Keys and values on both sides of a gutter 8 heights wide, twice the widest key-to-value
    gap: two regions, though their rows line up (issue 34)."""
    rows = [("Name:", "ANNA", "Name:", "OLE"), ("Street:", "HARBOUR RD", "Street:", "MILL LN"),
            ("Town:", "PORT 4410", "Town:", "RIVER 2210")]
    segs = []
    for i, (k1, v1, k2, v2) in enumerate(rows):
        y = 100 + 50 * i
        segs += [seg(40, y, 140, y + 30, k1), seg(240, y, 400, y + 30, v1),
                 seg(640, y, 740, y + 30, k2), seg(840, y, 1000, y + 30, v2)]
    assert [l.text for l in group_lines(segs)] == [
        "Name: ANNA", "Street: HARBOUR RD", "Town: PORT 4410", "Name: OLE", "Street: MILL LN", "Town: RIVER 2210"]
    # the same groups 2 heights apart: one table, read row by row (as the receipts of the samples)
    near = [s if s.left < 500 else seg(s.left - 180, s.top, s.right - 180, s.bottom, s.text) for s in segs]
    assert [l.text for l in group_lines(near)][0] == "Name: ANNA Name: OLE"


def test_a_label_in_small_type_beside_lines_in_large_type_is_read_after_them():
    big = column(40, 700, 30, 70, ["CUSTOM GIFT BOXES", "PRINTED TO ORDER", "FREE DESIGN"], h=48)
    label = column(980, 1140, 42, 70, ["ODM OEM", "(PACKAGING)"], h=28)
    assert [l.text for l in group_lines(big + label)] == [
        "CUSTOM GIFT BOXES", "PRINTED TO ORDER", "FREE DESIGN", "ODM OEM", "(PACKAGING)"]
    # a price far to the right of each item, in the same type, stays on its row (a receipt)
    prices = column(980, 1060, 30, 70, ["1.00", "2.00", "3.00"], h=48)
    assert [l.text for l in group_lines(big + prices)] == [
        "CUSTOM GIFT BOXES 1.00", "PRINTED TO ORDER 2.00", "FREE DESIGN 3.00"]


def test_a_skewed_table_still_lines_up():
    # scanned 2 degrees off: the right cells sit 20 px lower than their row's left cell
    t = math.tan(math.radians(2))

    def tilted(x0, x1, y0, text):
        box = [[x0, y0 + t * x0], [x1, y0 + t * x1], [x1, y0 + 30 + t * x1], [x0, y0 + 30 + t * x0]]
        return Segment(box, text, 0.9)

    rows = [tilted(40, 300, 100 + 45 * i, f"NAME {i}") for i in range(5)]
    rows += [tilted(560, 640, 100 + 45 * i, f"{i}.00") for i in range(5)]
    assert [l.text for l in group_lines(rows)] == [f"NAME {i} {i}.00" for i in range(5)]


def test_a_line_keeps_its_segments_in_order():
    [line] = group_lines([seg(400, 52, 600, 108, "4821"), seg(45, 55, 372, 108, "INVOICE")])
    assert [(p.text, p.left) for p in line.parts] == [("INVOICE", 45), ("4821", 400)]


def ink_profile(width, blanks):
    """One bool per column: ink everywhere but in the ``(start, end)`` blank runs."""
    ink = [True] * width
    for a, b in blanks:
        ink[a:b] = [False] * (b - a)
    return ink


def test_a_space_the_recogniser_dropped_comes_back_from_the_blank_between_the_words():
    # "TICKET5590": characters 25-30 px apart, a 17 px blank between T and 5 (ink 29 px tall),
    # 3-6 px blanks between letters (the measured DejaVu Sans Bold page)
    centres = [10, 35, 60, 85, 110, 140, 185, 212, 240, 268]
    letter_gaps = [(c + 10, c + 14) for c in centres[:-1]]
    ink = ink_profile(290, letter_gaps + [(150, 167)])
    assert restore_spaces("TICKET5590", centres, ink, 29) == "TICKET 5590"
    # the same distances without a wide blank (a wide letter, not a space): unchanged
    assert restore_spaces("TICKET5590", centres, ink_profile(290, letter_gaps), 29) == "TICKET5590"


def test_restoring_spaces_keeps_what_is_there_and_leaves_what_it_cannot_judge():
    centres = [10, 35, 60, 100, 125]
    ink = ink_profile(140, [(70, 90)])
    assert restore_spaces("ABCDE", centres, ink, 29) == "ABC DE"
    assert restore_spaces("AB C DE", [10, 35, 47, 60, 80, 100, 125], ink, 29) == "AB C DE"  # kept as read
    assert restore_spaces("ABCDE", centres[:4], ink, 29) == "ABCDE"  # positions do not match the text
    assert restore_spaces("ABC", [10, 35, 60], ink, 29) == "ABC"  # too short to know its pitch
    assert restore_spaces("西安东路口", centres, ink, 29) == "西安东路口"  # never between ideographs
