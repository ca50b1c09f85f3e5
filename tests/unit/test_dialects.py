"""Dialects and their parsers on recorded answers in HunyuanOCR's formats; the openai engine per
task against the fake server (exact prompt and sampling received, parsed answer); rapid's
unsupported_task."""

import numpy as np
import pytest

from schemas.reading import WARNING_TRUNCATED_MAX_TOKENS, WARNING_TRUNCATED_REPETITION
from schemas.tasks import TaskParams
from tests.engines import read_all
from services.infer.engines.base import EngineOutput, EngineTask, UnparsableOutput, UnsupportedTask
from services.infer.engines.dialects import dialect, parsers
from services.infer.engines.registry import engines_for
from tests.unit.test_openai_engine import OK, FakeServer, engine, page

FIELDS = ("姓名", "性别", "身份证号")
EXTRACT = EngineTask("extract", TaskParams(fields=FIELDS))

# recorded-style HunyuanOCR answers
DOC_MD = ("```markdown\n# 发票\n\n<table><tr><td>品名</td><td>金额</td></tr><tr><td>服务费</td><td>97.50</td></tr>"
          "</table>\n\n合计 $97.50$\n```")
FIELDS_FENCED = '```json\n{"姓名": "张三", "性别": "男", "身份证号": "110101199003071234"}\n```'
FIELDS_MISSING = '识别结果如下：\n{"姓名": "李四", "身份证号": 110101199003071235, "民族": "汉"}\n以上。'
LOOPING = "# Title\n\nSome text.\n" + "| a | b | c |\n" * 60
CUT_FIELDS = '```json\n{"姓名": "张三", "性别": "男", "身份证号": "1101011990'
PROSE = "图片中是一张身份证，姓名是张三。"


def test_markdown_with_html_table_is_unfenced():
    md, w = parsers.parse_text(DOC_MD)
    assert md.startswith("# 发票\n\n<table><tr><td>品名</td>") and md.endswith("合计 $97.50$")
    assert w == ()


def test_a_mermaid_fence_is_kept_as_the_markdown_that_marks_the_diagram():
    chart = "```mermaid\ngraph TD\n  A --> B\n```"
    assert parsers.parse_text(f"\n{chart}\n") == (chart, ())
    assert parsers.parse_text("```markdown\n| a | b |\n```") == ("| a | b |", ())


def test_repeated_tail_is_trimmed_and_flagged():
    md, w = parsers.parse_text(LOOPING)
    assert md == "# Title\n\nSome text.\n| a | b | c |"
    assert w == (WARNING_TRUNCATED_REPETITION,)


def test_fields_in_a_code_fence():
    f, w = parsers.parse_fields(FIELDS_FENCED, FIELDS)
    assert f == {"姓名": "张三", "性别": "男", "身份证号": "110101199003071234"} and w == ()
    assert list(f) == list(FIELDS)


def test_fields_in_prose_missing_one_extra_dropped_values_strings():
    f, _ = parsers.parse_fields(FIELDS_MISSING, FIELDS)
    assert f == {"姓名": "李四", "性别": None, "身份证号": "110101199003071235"}


def test_fields_in_request_order_and_loose_key_match():
    f, _ = parsers.parse_fields("{'Total': 9.5, 'invoice  number': 'A-1'}", ("Invoice Number", "total"))
    assert list(f.items()) == [("Invoice Number", "A-1"), ("total", "9.5")]


def test_fields_cut_at_max_tokens_are_returned_marked():
    f, w = parsers.parse_fields(CUT_FIELDS, FIELDS, (WARNING_TRUNCATED_MAX_TOKENS,))
    assert f == {"姓名": "张三", "性别": "男", "身份证号": None} and w == (WARNING_TRUNCATED_MAX_TOKENS,)


def test_cut_answer_with_nothing_readable_is_unparsable():
    with pytest.raises(UnparsableOutput) as e:
        parsers.parse_fields('```json\n{"姓名": "张', FIELDS, (WARNING_TRUNCATED_MAX_TOKENS,))
    assert e.value.raw == '```json\n{"姓名": "张' and e.value.warnings == (WARNING_TRUNCATED_MAX_TOKENS,)


def test_prose_is_unparsable_keeping_raw():
    with pytest.raises(UnparsableOutput) as e:
        parsers.parse_fields(PROSE, FIELDS)
    assert e.value.raw == PROSE


HUNYUAN = {
    EngineTask("doc_parse"): ("提取文档图片中正文的所有信息用markdown格式表示，其中页眉、页脚部分忽略，表格用html格式表达，"
                              "文档中公式用latex格式表示，按照阅读顺序组织进行解析。", 4096),
    EngineTask("table"): ("把图中的表格解析为HTML。", 4096),
    EngineTask("formula"): ("识别图片中的公式，用LaTeX格式表示。", 2048),
    EngineTask("chart"): ("解析图中的图表，对于流程图使用Mermaid格式表示，其他图表使用Markdown格式表示。", 4096),
    EXTRACT: ("提取图片中的: ['姓名','性别','身份证号'] 的字段内容，并按照 JSON 格式返回。", 2048),
    EngineTask("translate", TaskParams(target_lang="en")): (
        "先提取文字，再将文字内容翻译为英文。若是文档，则其中页眉、页脚忽略。公式用latex格式表示，表格用html格式表示。", 4096),
}


@pytest.mark.parametrize("task", list(HUNYUAN), ids=lambda t: t.name)
def test_hunyuan_prompt_and_sampling(task):
    sp = dialect("auto", "tencent/HunyuanOCR").sampling(task)
    assert (sp.prompt, sp.max_tokens) == HUNYUAN[task]
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (0.0, 1.0, -1, 1.08)


def test_generic_prompts_are_plain_english_without_vllm_extras():
    d = dialect("auto", "some/other-ocr-vlm")
    assert d.name == "generic"
    sp = d.sampling(EngineTask("extract", TaskParams(fields=("date", "total"))))
    assert sp.prompt.startswith('Extract these fields from the image: ["date", "total"]. Answer with one JSON object')
    assert (sp.top_k, sp.repetition_penalty, sp.temperature) == (None, None, 0.0)
    assert "into German" in d.sampling(EngineTask("translate", TaskParams(target_lang="de"))).prompt


async def test_rapid_answers_unsupported_task_naming_the_vlm_engines():
    from services.infer.engines.rapid import RapidOcrEngine

    eng = RapidOcrEngine()
    (out,) = await read_all(eng, [np.full((32, 32, 3), 255, np.uint8)], EXTRACT, timeout_s=5)
    assert isinstance(out, UnsupportedTask)
    assert str(out) == ("engine 'rapidocr' cannot do task 'extract'; engines that can: vllm, openai (to run one, "
                        "set OCRSTREAM_ENGINE__ENGINE and its model on every stage: docs/engines.md#choosing-an-engine)")
    assert engines_for("ocr") == ("rapidocr", "vllm", "openai")
    await eng.close()


CANNED = {  # task -> (answer, finish_reason, expected result, expected warnings)
    EngineTask("doc_parse"): (DOC_MD, "stop", parsers.parse_text(DOC_MD)[0], ()),
    EngineTask("table"): ("<table><tr><td>1</td></tr></table>", "stop", "<table><tr><td>1</td></tr></table>", ()),
    EngineTask("formula"): ("```latex\n\\frac{a}{b}\n```", "stop", "\\frac{a}{b}", ()),
    EngineTask("chart"): (LOOPING, "stop", parsers.parse_text(LOOPING)[0], (WARNING_TRUNCATED_REPETITION,)),
    EXTRACT: (CUT_FIELDS, "length", {"姓名": "张三", "性别": "男", "身份证号": None}, (WARNING_TRUNCATED_MAX_TOKENS,)),
    EngineTask("translate", TaskParams(target_lang="en")): ("Invoice\nTotal 97.50", "stop", "Invoice\nTotal 97.50", ()),
}


@pytest.mark.parametrize("task", list(CANNED), ids=lambda t: t.name)
async def test_openai_engine_per_task(task):
    with FakeServer() as srv:
        srv.canned[HUNYUAN[task][0]] = CANNED[task][:2]
        eng = engine(srv.url)
        (out,) = await read_all(eng, [page(OK)], task, timeout_s=10)
        body = srv.requests[-1]["body"]
        assert body["messages"][1]["content"][1]["text"] == HUNYUAN[task][0]
        assert (body["temperature"], body["top_p"], body["top_k"], body["repetition_penalty"], body["max_tokens"]) == \
            (0.0, 1.0, -1, 1.08, HUNYUAN[task][1])
        assert isinstance(out, EngineOutput) and out.segments == []
        assert out.answer == CANNED[task][2] and out.warnings == CANNED[task][3]
        await eng.close()


async def test_openai_engine_prose_for_extract_is_unparsable_output():
    with FakeServer() as srv:
        srv.canned[HUNYUAN[EXTRACT][0]] = (PROSE, "stop")
        eng = engine(srv.url)
        (out,) = await read_all(eng, [page(OK)], EXTRACT, timeout_s=10)
        assert isinstance(out, UnparsableOutput) and out.raw == PROSE
        await eng.close()


async def test_openai_engine_max_tokens_capped_by_its_own():
    with FakeServer() as srv:
        eng = engine(srv.url, max_tokens=1000)
        await read_all(eng, [page(OK)], EngineTask("doc_parse"), timeout_s=10)
        assert srv.requests[-1]["body"]["max_tokens"] == 1000
        await eng.close()


def test_cut_answer_with_a_raw_newline_or_a_bad_escape_keeps_the_other_pairs():
    """A cut answer's pairs are read one by one: a value with a raw line break is read as it is
    (JSON forbids it, models write it), a pair with an invalid escape is skipped; neither raises
    (a ValueError out of the parser failed the whole engine batch)."""
    cut = '{"address": "1 Main St\nSpringfield", "id": "A\\uZZ12", "total": "9.5", "date": "2024-'
    f, w = parsers.parse_fields(cut, ("address", "id", "total", "date"), (WARNING_TRUNCATED_MAX_TOKENS,))
    assert f == {"address": "1 Main St\nSpringfield", "id": None, "total": "9.5", "date": None}
    assert w == (WARNING_TRUNCATED_MAX_TOKENS,)


@pytest.mark.parametrize(("answer", "value"), [
    ("{'a': b'x'}", "b'x'"), ("{'a': {1, 2}}", "{1, 2}"), ("{'a': ...}", "Ellipsis"), ("{'a': 1j}", "1j"),
    ("{'a': {(1, 2): 'x'}}", "{(1, 2): 'x'}"),
])
def test_python_literal_values_json_cannot_write_are_kept_as_text(answer, value):
    """A Python-literal answer may hold bytes, sets, complex numbers, Ellipsis or tuple keys:
    each is the value's text, never a TypeError out of the parser."""
    f, _ = parsers.parse_fields(answer, ("a",))
    assert f == {"a": value}


def test_a_complete_answer_with_a_raw_line_break_in_a_value_is_read():
    """Models write a multi-line value (an address) with a raw line break inside the string: the
    JSON is read anyway (not ``unparsable_output``)."""
    f, w = parsers.parse_fields('```json\n{"address": "1 Main St\nSpringfield", "total": "9.5"}\n```',
                                ("address", "total"))
    assert f == {"address": "1 Main St\nSpringfield", "total": "9.5"} and w == ()


def test_a_key_one_field_names_exactly_is_never_copied_to_a_look_alike_field():
    from services.infer.engines.dialects.parsers import parse_fields

    fields, _ = parse_fields('{"ab": "1"}', ("a b", "ab"))
    assert fields == {"a b": None, "ab": "1"}
    fields, _ = parse_fields('{"Invoice Number": "INV-7"}', ("invoice number",))
    assert fields == {"invoice number": "INV-7"}  # the loose match still reads a key in another case
