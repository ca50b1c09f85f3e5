"""Tasks beyond text spotting through the real pipeline.

Infer runs its ``openai`` engine against a loopback OpenAI-compatible server
(:class:`tests.stack.LoopbackOcrServer`) that answers each task's prompt with a recorded answer in
HunyuanOCR's formats; Kafka, Redis, MariaDB, S3 and the four stage processes are the real stack.
Engine calls are counted on the server (``posts``, every chat completion it answered).

Checked, per task (``doc_parse``, ``table``, ``formula``, ``chart``, ``extract``, ``translate``): the
exact prompt and sampling the server receives (the ``hunyuan`` dialect, picked by ``auto`` for the
model ``tencent/HunyuanOCR``) and the exact result stored: on ``ocr.completed`` (what
:meth:`Pipeline.run` returns), in MariaDB (``requests.document_json``, ``result_fields``) and in S3
(the stored output at ``result_uri``). Answers: Markdown with an HTML table, a fenced table, a
formula, a fenced Mermaid chart, JSON fields in a code fence with one missing, a JSON list of
one-field objects with one missing, a translation looping on a repeated tail (trimmed, marked
``truncated_repetition``), an extraction cut at ``max_tokens`` (``finish_reason`` "length": the
fields read before the cut, marked ``truncated_max_tokens``, not failed), prose where JSON was
asked (``unparsable_output``, raw answer kept). Cache: one image with two tasks is two engine
calls; the same fields again, or in another order, a hit with no call; a subset of a stored
extraction answered from it (tier ``fields``) with only those fields and no call, a field it
lacks computed; a cut extraction never answers a subset. And the CPU engine refusing ``extract``
with ``unsupported_task`` while it reads ``doc_parse`` and ``table`` with its layout and table models.
"""

from __future__ import annotations

import json

import pytest

from schemas.events import OcrOutput, ResultDocument
from schemas.keys import field_family_id, field_index_key, split_cache_key
from schemas.tasks import TaskParams
from services.common.s3 import ObjectStore
from services.common.cache.keys import CacheKeySettings
from services.infer.engines.base import EngineTask
from services.infer.engines.dialects import dialect
from tests.conftest import text_image
from tests.pages import ORDER_TABLE, ORDER_TITLE, order_page
from tests.stack import LoopbackOcrServer, db_rows, namespaced_pipeline

FIELDS = ("invoice number", "date", "total")
HUNYUAN = dialect("hunyuan")


def sampling(task: str, fields: tuple[str, ...] | None = None, to: str | None = None):
    params = TaskParams(fields=fields) if fields else TaskParams(target_lang=to) if to else None
    return HUNYUAN.sampling(EngineTask(task, params))


EXTRACT = sampling("extract", FIELDS)
SELLER = sampling("extract", ("seller",))
PARSE = sampling("doc_parse")
TABLE_MD = "# Invoice INV-7\n\n<table><tr><td>Item</td><td>Price</td></tr><tr><td>Pen</td><td>3.00</td></tr></table>"
TABLE = sampling("table")
TABLE_HTML = "<table><tr><th>Item</th><th>Qty</th></tr><tr><td>Pen</td><td>2</td></tr></table>"
FORMULA = sampling("formula")
LATEX = r"\[E = mc^{2}\]"
CHART = sampling("chart")
MERMAID = "graph TD\n  A[Order] --> B[Invoice]\n  B --> C[Paid]"
TRANSLATE = sampling("translate", to="en")
LOOPING = "Invoice INV-7\nTotal: 97.50 EUR\n" + "Thank you for your order. " * 40
ID_CARD = ("姓名", "性别", "身份证号")
ID_EXTRACT = sampling("extract", ID_CARD)
CUT = ("invoice number", "date", "total", "due date")
CUT_EXTRACT = sampling("extract", CUT)
CUT_SUBSET = sampling("extract", ("invoice number", "total"))
SUPER = ("seller", "invoice number", "date", "total")
SUPER_EXTRACT = sampling("extract", SUPER)
OUTSIDE = sampling("extract", ("total", "iban"))


SLOTS = ("markdown", "html", "latex", "fields", "translation")


def hunyuan_sent(prompt: str, max_tokens: int) -> dict:
    """What the loopback server records of a request in the ``hunyuan`` dialect: HunyuanOCR's
    prompt and its official client's sampling (temperature 0, top_p 1, top_k off, penalty 1.08)."""
    return {"prompt": prompt, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": max_tokens,
            "repetition_penalty": 1.08}


async def stored(doc: ResultDocument) -> tuple[OcrOutput, ResultDocument]:
    """The stored output at ``doc.result_uri`` (S3) and the document of ``doc``'s ``requests`` row."""
    output = OcrOutput.model_validate_json(await ObjectStore(CacheKeySettings().s3).get_uri(doc.result_uri))
    [row] = db_rows("SELECT document_json FROM requests WHERE request_id = %s", doc.request_id)
    return output, ResultDocument.model_validate_json(row["document_json"])


# first: the session's (CPU) pipeline must start before this module's openai pipeline sets its environment
async def test_the_cpu_engine_refuses_extract_naming_the_engines_that_can(pipeline):
    bad, good = await pipeline.run([(text_image(["CPU EXTRACT 3131"]), "c.png")], task="extract",
                                   task_params=TaskParams(fields=("total",))) + \
        await pipeline.run([(text_image(["CPU NEXT 3132"]), "c2.png")])
    assert bad.status == "error" and bad.error.code.value == "unsupported_task"
    assert "vllm" in bad.error.message and "openai" in bad.error.message
    assert good.status == "ok" and "3132" in good.text


async def test_the_cpu_engine_reads_doc_parse_to_markdown_and_table_to_html(pipeline):
    table = "<table>" + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in ORDER_TABLE) + "</table>"
    parsed, tab = await pipeline.run([(order_page(), "order.png")], task="doc_parse") + \
        await pipeline.run([(order_page(), "order.png")], task="table")
    assert parsed.status == "ok", parsed.error
    title, paragraph, html = parsed.markdown.split("\n\n")
    assert (title, html) == (f"# {ORDER_TITLE}", table) and paragraph.startswith("The order below was placed on")
    assert parsed.text == parsed.markdown and parsed.task == "doc_parse" and parsed.lines == []
    assert tab.status == "ok" and tab.html == table and tab.text == table and tab.markdown is None
    assert parsed.cache_key != tab.cache_key


@pytest.fixture(scope="module")
def server():
    srv = LoopbackOcrServer("WARM UP")
    srv.replies = {
        # JSON in a code fence, one field not on the page
        EXTRACT.prompt: ('```json\n{"invoice number": "INV-7", "date": "2026-12-01"}\n```', "stop"),
        SELLER.prompt: ("I could not find a seller on this page.", "stop"),
        PARSE.prompt: (f"```markdown\n{TABLE_MD}\n```", "stop"),
        TABLE.prompt: (f"```html\n{TABLE_HTML}\n```", "stop"),
        FORMULA.prompt: (LATEX, "stop"),
        CHART.prompt: (f"```mermaid\n{MERMAID}\n```", "stop"),
        TRANSLATE.prompt: (LOOPING, "stop"),
        # a list of one-field objects (merged), the ID number not on the card
        ID_EXTRACT.prompt: ('```json\n[{"姓名": "张三"}, {"性别": "男"}]\n```', "stop"),
        CUT_EXTRACT.prompt: ('```json\n{"invoice number": "INV-9", "date": "2026-1', "length"),
        CUT_SUBSET.prompt: ('{"invoice number": "INV-9", "total": "12.00"}', "stop"),
        SUPER_EXTRACT.prompt: ('```json\n{"seller": "ACME GmbH", "invoice number": "INV-8", "date": "2026-11-30", '
                               '"total": "41.00 EUR"}\n```', "stop"),
        OUTSIDE.prompt: ('```json\n{"total": "41.00 EUR"}\n```', "stop"),
    }
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def vlm_pipeline(stack_env, server, tmp_path_factory):
    extra = {"OCRSTREAM_ENGINE_KIND": "openai", "OCRSTREAM_OPENAI_BASE_URL": server.url,
             "OCRSTREAM_OPENAI_READY_TIMEOUT_S": "60"}
    with namespaced_pipeline(tmp_path_factory.mktemp("tasks-logs"), extra, partitions=2) as p:
        yield p


async def test_extract_sends_the_models_prompt_and_stores_exactly_the_fields(vlm_pipeline, server):
    image = text_image(["INVOICE INV-7 2026-12-01"])
    posts = server.posts
    [doc] = await vlm_pipeline.run([(image, "inv.png")], task="extract", task_params=TaskParams(fields=FIELDS))
    assert doc.status == "ok", doc.error
    assert doc.fields == {"invoice number": "INV-7", "date": "2026-12-01", "total": None}
    assert doc.task == "extract" and doc.task_params == TaskParams(fields=FIELDS)
    assert server.posts == posts + 1
    assert server.received[-1] == hunyuan_sent(
        "提取图片中的: ['invoice number','date','total'] 的字段内容，并按照 JSON 格式返回。", 2048)
    assert doc.text == '{"invoice number":"INV-7","date":"2026-12-01","total":null}' and doc.warnings == []
    output, row = await stored(doc)
    assert list(output.fields.items()) == list(doc.fields.items()) and output.text == doc.text
    assert (output.task, output.task_params, output.cache_key) == ("extract", TaskParams(fields=FIELDS), doc.cache_key)
    assert row == doc
    rows = db_rows("SELECT position, field_name, value FROM result_fields WHERE cache_key = %s ORDER BY position",
                   doc.cache_key)
    assert [(r["position"], r["field_name"], r["value"]) for r in rows] == [
        (0, "invoice number", "INV-7"), (1, "date", "2026-12-01"), (2, "total", None)]

    # the same fields in another order: the same cache key, answered from the cache
    [again] = await vlm_pipeline.run([(image, "inv-again.png")], task="extract",
                                     task_params=TaskParams(fields=("total", "invoice number", "date")))
    assert again.status == "ok" and again.cache_hit and again.cache_key == doc.cache_key
    assert list(again.fields.items()) == [("total", None), ("invoice number", "INV-7"), ("date", "2026-12-01")]
    assert again.text == '{"total":null,"invoice number":"INV-7","date":"2026-12-01"}'  # the order asked
    assert server.posts == posts + 1  # no engine call


async def test_doc_parse_and_ocr_of_one_image_are_two_keys_and_two_calls(vlm_pipeline, server):
    image = text_image(["PARSE ME 9911"])
    posts = server.posts
    parsed, spotted = await vlm_pipeline.run([(image, "p.png")], task="doc_parse") + \
        await vlm_pipeline.run([(image, "p.png")])
    assert parsed.status == "ok" and parsed.markdown == TABLE_MD and parsed.text == TABLE_MD
    assert server.received[-2] == hunyuan_sent(PARSE.prompt, 4096)
    output, row = await stored(parsed)
    assert (output.markdown, output.text, output.task, output.warnings) == (TABLE_MD, TABLE_MD, "doc_parse", [])
    assert row == parsed and all(getattr(parsed, k) is None for k in SLOTS if k != "markdown")
    assert spotted.status == "ok" and spotted.text == "WARM UP" and spotted.markdown is None
    assert parsed.cache_key != spotted.cache_key and server.posts == posts + 2


async def test_prose_instead_of_json_is_unparsable_output_and_the_next_image_goes_through(vlm_pipeline, server):
    bad, good = await vlm_pipeline.run(
        [(text_image(["NO SELLER 5150"]), "s.png")], task="extract", task_params=TaskParams(fields=("seller",))) + \
        await vlm_pipeline.run([(text_image(["NEXT ONE 5151"]), "n.png")])
    assert bad.status == "error" and bad.error.code.value == "unparsable_output"
    assert bad.raw_output == "I could not find a seller on this page."
    assert bad.fields is None and not bad.cache_hit
    assert good.status == "ok" and good.text == "WARM UP"


@pytest.mark.parametrize("task,params,sp,slot,answer,warnings,max_tokens", [
    ("table", None, TABLE, "html", TABLE_HTML, [], 4096),  # in an ```html fence: the fence goes
    ("formula", None, FORMULA, "latex", LATEX, [], 2048),
    ("chart", None, CHART, "markdown", f"```mermaid\n{MERMAID}\n```", [], 4096),  # the mermaid fence stays
    # looping on a repeated tail: cut to one copy, marked
    ("translate", TaskParams(target_lang="en"), TRANSLATE, "translation",
     "Invoice INV-7\nTotal: 97.50 EUR\nThank you for your order.", ["truncated_repetition"], 4096),
], ids=["table", "formula", "chart", "translate"])
async def test_a_text_task_sends_the_models_prompt_and_stores_its_answer(vlm_pipeline, server, task, params, sp, slot,
                                                                         answer, warnings, max_tokens):
    posts = server.posts
    [doc] = await vlm_pipeline.run([(text_image([f"{task.upper()} 4242"]), f"{task}.png")], task=task,
                                   task_params=params)
    assert doc.status == "ok", doc.error
    assert server.posts == posts + 1 and server.received[-1] == hunyuan_sent(sp.prompt, max_tokens)
    assert (getattr(doc, slot), doc.text, doc.warnings, doc.task, doc.task_params) == (answer, answer, warnings, task,
                                                                                       params)
    assert all(getattr(doc, k) is None for k in SLOTS if k != slot) and doc.raw_output is None
    output, row = await stored(doc)
    assert (getattr(output, slot), output.text, output.warnings, output.task_params) == (answer, answer, warnings, params)
    assert row == doc


async def test_a_json_list_of_fields_with_one_missing_is_stored_with_null(vlm_pipeline, server):
    posts = server.posts
    [doc] = await vlm_pipeline.run([(text_image(["ID CARD 110101"]), "id.png")], task="extract",
                                   task_params=TaskParams(fields=ID_CARD))
    assert doc.status == "ok", doc.error
    assert server.posts == posts + 1
    assert server.received[-1] == hunyuan_sent("提取图片中的: ['姓名','性别','身份证号'] 的字段内容，并按照 JSON 格式返回。", 2048)
    assert list(doc.fields.items()) == [("姓名", "张三"), ("性别", "男"), ("身份证号", None)]
    assert doc.text == '{"姓名":"张三","性别":"男","身份证号":null}'
    output, row = await stored(doc)
    assert list(output.fields.items()) == list(doc.fields.items()) and row == doc
    rows = db_rows("SELECT position, field_name, value FROM result_fields WHERE cache_key = %s ORDER BY position",
                   doc.cache_key)
    assert [(r["position"], r["field_name"], r["value"]) for r in rows] == [
        (0, "姓名", "张三"), (1, "性别", "男"), (2, "身份证号", None)]


async def test_an_extraction_cut_at_max_tokens_keeps_what_was_read_marked_and_answers_no_subset(vlm_pipeline, server):
    """Cut at ``max_tokens``: the request ends ok with the fields read before the cut, the rest
    null, marked ``truncated_max_tokens`` (parsers.py says why: not ``truncated`` as an error). Its
    nulls may be the cut, so it is not in the field index: a subset of it is computed again."""
    image = text_image(["INVOICE INV-9 CUT"])
    posts = server.posts
    [cut] = await vlm_pipeline.run([(image, "cut.png")], task="extract", task_params=TaskParams(fields=CUT))
    assert cut.status == "ok", cut.error
    assert server.posts == posts + 1 and server.received[-1] == hunyuan_sent(CUT_EXTRACT.prompt, 2048)
    assert list(cut.fields.items()) == [("invoice number", "INV-9"), ("date", None), ("total", None), ("due date", None)]
    assert cut.warnings == ["truncated_max_tokens"] and cut.raw_output is None
    output, row = await stored(cut)
    assert (output.fields, output.warnings) == (cut.fields, ["truncated_max_tokens"]) and row == cut
    _, sha = split_cache_key(cut.cache_key)
    assert await ObjectStore(CacheKeySettings().s3).list_keys(f"fieldsets/{sha}/") == []

    [sub] = await vlm_pipeline.run([(image, "cut-sub.png")], task="extract",
                                   task_params=TaskParams(fields=("invoice number", "total")))
    assert (sub.status, sub.cache_hit, sub.warnings) == ("ok", False, [])
    assert list(sub.fields.items()) == [("invoice number", "INV-9"), ("total", "12.00")]
    assert server.posts == posts + 2 and server.received[-1] == hunyuan_sent(CUT_SUBSET.prompt, 2048)


async def test_a_subset_of_a_stored_extraction_is_answered_from_it_with_no_engine_call(vlm_pipeline, server):
    image = text_image(["INVOICE INV-8 ACME"])
    posts = server.posts
    [whole] = await vlm_pipeline.run([(image, "w.png")], task="extract", task_params=TaskParams(fields=SUPER))
    assert whole.status == "ok" and not whole.cache_hit and server.posts == posts + 1
    assert list(whole.fields.items()) == [("seller", "ACME GmbH"), ("invoice number", "INV-8"), ("date", "2026-11-30"),
                                          ("total", "41.00 EUR")]
    # its entry in the field index, in S3 next to the document
    store = ObjectStore(CacheKeySettings().s3)
    _, sha = split_cache_key(whole.cache_key)
    family = field_family_id(CacheKeySettings().generation("extract", TaskParams(fields=SUPER)))
    entry = field_index_key(whole.cache_key, family, 4)
    assert [k for k, _ in await store.list_keys(f"fieldsets/{sha}/")] == [entry]
    assert json.loads(await store.get(entry)) == {"cache_key": whole.cache_key, "fields": sorted(SUPER)}

    # the same fields again: a hit of the same key, no engine call
    [again] = await vlm_pipeline.run([(image, "w2.png")], task="extract", task_params=TaskParams(fields=SUPER))
    assert (again.cache_hit, again.cache_key, again.fields, server.posts) == (True, whole.cache_key, whole.fields,
                                                                             posts + 1)

    # two of its fields, in another order: answered from it, only those, no engine call
    [some] = await vlm_pipeline.run([(image, "s.png")], task="extract", task_params=TaskParams(fields=("total", "seller")))
    assert (some.status, some.cache_hit, some.cache_tier) == ("ok", True, "fields")
    assert (some.cache_key, some.result_uri) == (whole.cache_key, whole.result_uri)  # the extraction answering
    assert list(some.fields.items()) == [("total", "41.00 EUR"), ("seller", "ACME GmbH")]
    assert some.text == '{"total":"41.00 EUR","seller":"ACME GmbH"}'
    assert some.task_params == TaskParams(fields=("total", "seller")) and server.posts == posts + 1
    output, row = await stored(some)
    assert row == some and list(output.fields) == list(SUPER)  # the stored extraction as it was
    rows = db_rows("SELECT f.field_name, f.value FROM requests r JOIN result_fields f ON f.cache_key = r.cache_key "
                   "WHERE r.request_id = %s ORDER BY f.position", some.request_id)
    assert [(r["field_name"], r["value"]) for r in rows] == list(whole.fields.items())

    # a field it does not hold: computed
    [other] = await vlm_pipeline.run([(image, "o.png")], task="extract", task_params=TaskParams(fields=("total", "iban")))
    assert (other.status, other.cache_hit) == ("ok", False) and other.cache_key != whole.cache_key
    assert list(other.fields.items()) == [("total", "41.00 EUR"), ("iban", None)]
    assert server.posts == posts + 2 and server.received[-1] == hunyuan_sent(OUTSIDE.prompt, 2048)
