"""HunyuanOCR prompt building and text-spotting parsing, on recorded answer strings."""

import base64
import io
import json

import numpy as np
from PIL import Image

from services.common.cache.prompts import SPOTTING_JSON_PROMPT, SPOTTING_PROMPT
from services.common.cache.keys import CacheKeySettings
from services.infer.engines import hunyuan, hunyuan_prompts
from services.infer.engines.hunyuan import ParseStats, parse_spotting

W, H = 2000, 1000  # x pixels = 2 * x_norm, y pixels = y_norm


def boxes(segs):
    return [(s.text, s.box) for s in segs]


def quad(x1, y1, x2, y2):
    return [[x1, y1], [x2, y1], [x2, y2], [x1, y2]]


def test_well_formed_lines_one_per_line():
    out = "INVOICE(100,50),(400,90)\nNo. 4821(600,52),(800,88)\nTOTAL 97.50 EUR(100,900),(500,950)\n"
    segs = parse_spotting(out, W, H)
    assert boxes(segs) == [
        ("INVOICE", quad(200.0, 50.0, 800.0, 90.0)),
        ("No. 4821", quad(1200.0, 52.0, 1600.0, 88.0)),
        ("TOTAL 97.50 EUR", quad(200.0, 900.0, 1000.0, 950.0)),
    ]
    assert all(s.confidence == hunyuan.VLM_CONFIDENCE == 1.0 for s in segs)


def test_concatenated_items_chinese_text_and_parentheses():
    out = "发票号码(120,40),(380,80)金额(小写)(120,100),(300,140)ATLANTA (AP)(500,100),(700,140)"
    segs = parse_spotting(out, 1000, 500)
    assert boxes(segs) == [
        ("发票号码", quad(120.0, 20.0, 380.0, 40.0)),
        ("金额(小写)", quad(120.0, 50.0, 300.0, 70.0)),
        ("ATLANTA (AP)", quad(500.0, 50.0, 700.0, 70.0)),
    ]


def test_non_round_scaling_and_swapped_corners():
    segs = parse_spotting("abc(333,1),(1,999)", 640, 480)
    assert boxes(segs) == [("abc", quad(0.6, 0.5, 213.1, 479.5))]


def test_tagged_forms():
    f1 = "<ref>Hello</ref><quad>(10,20),(30,40)</quad><ref>World</ref><quad>(50,60),(70,80)</quad>"
    assert boxes(parse_spotting(f1, W, H)) == [("Hello", quad(20.0, 20.0, 60.0, 40.0)),
                                                ("World", quad(100.0, 60.0, 140.0, 80.0))]
    f2 = "<quad><pos_10><pos_20><pos_30><pos_40></quad><ref>你好</ref>"
    assert boxes(parse_spotting(f2, W, H)) == [("你好", quad(20.0, 20.0, 60.0, 40.0))]


def test_json_variant_box_bbox_and_quad_points():
    out = json.dumps([
        {"box": [100, 50, 400, 90], "text": "INVOICE"},
        {"bbox": [600, 52, 800, 88], "text": "编号 4821"},
        {"quad": [[100, 900], [500, 900], [500, 950], [100, 950]], "text": "TOTAL"},
    ], ensure_ascii=False)
    segs = parse_spotting(f"```json\n{out}\n```", W, H)
    assert boxes(segs) == [
        ("INVOICE", quad(200.0, 50.0, 800.0, 90.0)),
        ("编号 4821", quad(1200.0, 52.0, 1600.0, 88.0)),
        ("TOTAL", [[200.0, 900.0], [1000.0, 900.0], [1000.0, 950.0], [200.0, 950.0]]),
    ]


def test_json_truncated_and_malformed_entries_are_skipped():
    out = ('[{"box": [100, 50, 400, 90], "text": "A"}, {"box": [1, 2, 3], "text": "bad"}, '
           '{"box": ["x", 2, 3, 4], "text": "bad"}, {"text": "nobox"}, {"box": [10, 10, 20, 20], "text": "B"}, '
           '{"box": [500, 500, 6')
    st = ParseStats()
    segs = parse_spotting(out, W, H, stats=st)
    assert boxes(segs) == [("A", quad(200.0, 50.0, 800.0, 90.0)), ("B", quad(20.0, 10.0, 40.0, 20.0))]
    assert st.format == "json" and st.malformed == 3


def test_malformed_plain_entries_are_skipped_without_raising():
    out = (
        "Good(10,10),(20,20)\n"
        "NoParens 30,30,40,40\n"  # no coordinates at all: joins nothing, dropped as a coordless line
        "Letters(a,b),(5,6)\n"  # non-numeric coordinates
        "Missing 1,2),(3,4)\n"  # missing opening parenthesis
        "Next(50,50),(60,60)\n"
        "Truncated(70,70),(8"  # cut off mid entry
    )
    st = ParseStats()
    segs = parse_spotting(out, W, H, stats=st)
    assert boxes(segs) == [("Good", quad(20.0, 10.0, 40.0, 20.0)), ("Next", quad(100.0, 50.0, 120.0, 60.0))]
    assert st.malformed >= 3 and "truncated tail" in st.notes


def test_coordinates_beyond_1000_are_clamped_and_empty_boxes_dropped():
    out = "Edge(900,950),(1200,1100)Outside(1200,10),(1500,20)Neg(-5,10),(100,20)"
    segs = parse_spotting(out, W, H)
    assert boxes(segs) == [("Edge", quad(1800.0, 950.0, 2000.0, 1000.0)), ("Neg", quad(0.0, 10.0, 200.0, 20.0))]


def test_empty_and_no_text_answers():
    assert parse_spotting("", W, H) == []
    assert parse_spotting("   \n", W, H) == []
    assert parse_spotting("图片中没有文字。", W, H) == []
    assert parse_spotting("[]", W, H) == []
    assert parse_spotting("A(1,2),(3,4)", 0, 100) == []


def test_runaway_repetition_tail_is_trimmed():
    out = "Title(10,10),(90,30)" + "重复(10,40),(90,60)" * 50
    st = ParseStats()
    segs = parse_spotting(out, 1000, 1000, stats=st)
    assert boxes(segs) == [("Title", quad(10.0, 10.0, 90.0, 30.0)), ("重复", quad(10.0, 40.0, 90.0, 60.0))]
    assert st.tail_trimmed


def test_exact_duplicates_dropped_and_same_text_runs_capped():
    dup = "A(1,1),(2,2)B(3,3),(4,4)A(1,1),(2,2)"
    assert [s.text for s in parse_spotting(dup, 1000, 1000)] == ["A", "B"]
    # same text over and over, each box creeping over the one before (a loop): cut after max_run
    run = "".join(f"0.00({100 + i},{100 + i}),({300 + i},{140 + i})\n" for i in range(1, 21))
    stats = ParseStats()
    segs = parse_spotting(run, 1000, 1000, max_run=12, stats=stats)
    assert len(segs) == 12 and segs[-1].box[0] == [112.0, 112.0] and stats.runaway == 8


def test_a_table_column_of_the_same_value_is_kept_whole():
    # 30 cells reading "0", each in its own box: text, not a loop
    cells = "Qty(100,20),(200,40)\n" + "".join(f"0({100},{50 + 30 * i}),({140},{70 + 30 * i})\n" for i in range(30))
    stats = ParseStats()
    segs = parse_spotting(cells, 1000, 1000, stats=stats)
    assert [s.text for s in segs] == ["Qty"] + ["0"] * 30 and stats.runaway == 0


def test_thousands_of_nested_brackets_do_not_raise():
    # json.loads raises RecursionError (not ValueError) on deep nesting
    assert parse_spotting("[" * 5000, 1000, 1000) == []
    assert parse_spotting('{"a":' * 1500, 1000, 1000) == []
    # not JSON after all: read as the plain form
    [seg] = parse_spotting("[" * 1200 + "Hello(100,200),(300,400)", 1000, 1000)
    assert seg.text == "[" * 1200 + "Hello" and seg.box == [[100.0, 200.0], [300.0, 200.0], [300.0, 400.0], [100.0, 400.0]]


def test_clip_to_the_unpadded_image():
    segs = parse_spotting("x(0,0),(1000,1000)", 100, 200, clip=(50, 150))
    assert boxes(segs) == [("x", quad(0.0, 0.0, 50.0, 150.0))]


def test_trim_repeated_tail_keeps_one_copy_of_a_real_loop():
    loop = "Title(10,10),(90,30)\n" + "abc(10,40),(90,60)" * 20 + "abc(10,4"
    cut, trimmed = hunyuan.trim_repeated_tail(loop)
    assert trimmed and cut == "Title(10,10),(90,30)\nabc(10,40),(90,60)abc(10,4"
    # the same line over and over (short lines, under the span threshold)
    lines = "Head(1,1),(2,2)\n" + "Row(5,6),(7,8)\n" * 12
    assert hunyuan.trim_repeated_tail(lines) == ("Head(1,1),(2,2)\nRow(5,6),(7,8)\n", True)
    assert not hunyuan.has_tail_repetition("Head(1,1),(2,2)\n" + "Row(5,6),(7,8)\n" * 11)
    # 8 copies of a 17-character item are only 136 characters: not yet a loop
    assert not hunyuan.has_tail_repetition("abc(10,40),(90,60)" * 8)


def test_forms_leaders_and_long_numbers_are_not_loops():
    for text in ["Signature: " + "_" * 600, "Total 1" + "0" * 600, "Chapter 1 " + "." * 600 + " 5",
                 "Chapter 1 " + ". " * 300, "-=" * 300, "[ ] " * 200, "的" * 600, "\n" * 300,
                 "Name: ________(10,20),(300,40)\n" + "________(10,50),(300,70)\n" * 5]:
        assert not hunyuan.has_tail_repetition(text), text[:30]
        assert hunyuan.trim_repeated_tail(text) == (text, False)
    segs = parse_spotting("Signature: " + "_" * 40 + "(10,20),(500,40)", 1000, 1000)
    assert [s.text for s in segs] == ["Signature: " + "_" * 40]


def test_full_width_coordinates():
    out = "发票号码（120,40），（380,80）金额（小写）(120，100)，(300，140)"
    st = ParseStats()
    segs = parse_spotting(out, 1000, 500, stats=st)
    assert boxes(segs) == [("发票号码", quad(120.0, 20.0, 380.0, 40.0)), ("金额（小写）", quad(120.0, 50.0, 300.0, 70.0))]
    assert st.malformed == 0


def test_bracketed_plain_answer_is_not_taken_for_json():
    out = "[Note] see below(10,20),(30,40)\n{draft} copy(50,60),(70,80)"
    st = ParseStats()
    segs = parse_spotting(out, 1000, 1000, stats=st)
    assert [s.text for s in segs] == ["[Note] see below", "{draft} copy"]
    assert st.format == "plain"
    segs = parse_spotting('{"a": 1} total(10,20),(30,40)', 1000, 1000)
    assert [s.text for s in segs] == ['{"a": 1} total']


def test_text_with_parenthesised_pairs_is_not_debris():
    segs = parse_spotting("f(x),(y) here(10,20),(30,40)g(a), (b)(50,60),(70,80)", 1000, 1000)
    assert [s.text for s in segs] == ["f(x),(y) here", "g(a), (b)"]
    # real debris is still cut: a pair with letters, and a pair missing its "("
    segs = parse_spotting("A(1,1),(2,2)Bad(a,b),(5,6)Next(50,50),(60,60)Miss 1,2),(3,4)Last(7,7),(8,8)", 1000, 1000)
    assert [s.text for s in segs] == ["A", "Next", "Last"]


def test_prompts_are_the_official_ones():
    assert SPOTTING_PROMPT == "检测并识别图片中的文字，将文本坐标格式化输出。"
    assert "[0, 1000]" in SPOTTING_JSON_PROMPT
    raw = hunyuan_prompts.render_template(hunyuan_prompts.HUNYUAN_RAW_TEMPLATE, SPOTTING_PROMPT)
    assert raw.startswith("<｜hy_begin▁of▁sentence｜><｜hy_place▁holder▁no▁100｜>")
    assert raw.endswith(SPOTTING_PROMPT + "<｜hy_User｜>")
    # the one definition is the engines' default and the settings' (so the default cache key's)
    assert hunyuan_prompts.chat_messages("data:,")[1]["content"][1]["text"] == SPOTTING_PROMPT
    fields = CacheKeySettings.model_fields
    assert fields["vllm_prompt"].default is SPOTTING_PROMPT and fields["openai_prompt"].default is SPOTTING_PROMPT


def test_build_messages_inline_png():
    img = np.zeros((20, 30, 3), dtype=np.uint8)
    img[:, :, 0] = 200
    msgs = hunyuan_prompts.build_messages(img, "read")
    assert msgs[0] == {"role": "system", "content": ""}
    image_part, text_part = msgs[1]["content"]
    assert text_part == {"type": "text", "text": "read"}
    url = image_part["image_url"]["url"]
    assert image_part["type"] == "image_url" and url.startswith("data:image/png;base64,")
    back = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
    assert np.array_equal(back, img)
    assert hunyuan_prompts.build_messages(img, "x", fmt="jpeg")[1]["content"][0]["image_url"]["url"].startswith("data:image/jpeg")
    assert hunyuan_prompts.template_messages("p")[1]["content"] == [{"type": "image"}, {"type": "text", "text": "p"}]


def test_pad_for_vlm_keeps_pixels_in_place():
    thin = np.zeros((10, 4000, 3), dtype=np.uint8)
    out = hunyuan_prompts.pad_for_vlm(thin)
    assert out.shape == (32, 4000, 3) and (out[10:] == 255).all() and (out[:10] == 0).all()
    very_long = np.zeros((40, 9000, 3), dtype=np.uint8)
    assert hunyuan_prompts.pad_for_vlm(very_long).shape == (60, 9000, 3)
    normal = np.zeros((100, 200, 3), dtype=np.uint8)
    assert hunyuan_prompts.pad_for_vlm(normal) is normal


def test_an_answer_without_entries_is_one_whole_page_line_flagged():
    """Non-empty answer, nothing parses: status stays ok, the text is kept as one line boxing
    the whole (unpadded) image, confidence 0, warning ``unparsed_output``."""
    out = hunyuan.answer_to_output("<answer>```\nHello there,\n  world!\n```</answer>", (300, 64), (300, 40),
                                   ("truncated_max_tokens",), 0.0)
    assert out.warnings == ("truncated_max_tokens", "unparsed_output")
    assert [(s.text, s.box, s.confidence) for s in out.segments] == [
        ("Hello there, world!", [[0.0, 0.0], [300.0, 0.0], [300.0, 40.0], [0.0, 40.0]], 0.0)]
    # a box the parser drops (zero width) leaves its text: kept the same way
    out = hunyuan.answer_to_output("abc(5,5),(5,9)", (100, 100), (100, 100), (), 0.0)
    assert [s.text for s in out.segments] == ["abc(5,5),(5,9)"] and out.warnings == ("unparsed_output",)
    out = hunyuan.answer_to_output("<ref>x</ref><quad>(1,2)</quad>", (100, 100), (100, 100), (), 0.0)
    assert [s.text for s in out.segments] == ["x (1,2)"]


def test_empty_or_parsed_answers_get_no_unparsed_warning():
    assert hunyuan.answer_to_output("", (100, 100), (100, 100), (), 0.0).segments == []
    blank = hunyuan.answer_to_output(" \n ", (100, 100), (100, 100), (), 0.0)
    assert blank.segments == [] and blank.warnings == ()
    ok = hunyuan.answer_to_output("A(100,100),(500,500)", (100, 100), (100, 100), (), 0.0)
    assert [s.text for s in ok.segments] == ["A"] and ok.warnings == ()
    assert hunyuan.unparsed_text("<quad><pos_1><pos_2></quad>  ") == ""


def test_an_answer_that_says_there_is_no_text_is_an_empty_page():
    for answer in ("图片中没有文字。", "<answer>图中没有文字</answer>", "No text in the image.", "There is no text."):
        out = hunyuan.answer_to_output(answer, (100, 100), (100, 100), (), 0.0)
        assert out.segments == [] and out.warnings == (), answer
    # a real line that merely contains the words is still text
    out = hunyuan.answer_to_output("No text messages after 9 pm", (100, 100), (100, 100), (), 0.0)
    assert [s.text for s in out.segments] == ["No text messages after 9 pm"]
