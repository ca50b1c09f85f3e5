"""Tasks beyond text spotting through the real pipeline (issue #24).

Infer runs its ``openai`` engine against a loopback OpenAI-compatible server
(:class:`tests.stack.LoopbackOcrServer`) that answers each task's prompt with a recorded answer in
HunyuanOCR's formats; Kafka, Redis, MariaDB, S3 and the four stage processes are the real stack.
Checked: the exact prompt and sampling the server receives (the ``hunyuan`` dialect, picked by
``auto`` for the model ``tencent/HunyuanOCR``), the exact result stored (the result document, the
``result_fields`` rows), a repeat with the same fields in another order answered from the cache
with no engine call, prose where JSON was asked ending ``unparsable_output`` with the raw answer
kept, and the CPU engine refusing ``extract`` with ``unsupported_task`` while it reads
``doc_parse`` and ``table`` with its layout and table models.
"""

from __future__ import annotations

import pytest

from schemas.tasks import TaskParams
from services.infer.engines.base import EngineTask
from services.infer.engines.dialects import dialect
from tests.conftest import text_image
from tests.pages import ORDER_TABLE, ORDER_TITLE, order_page
from tests.stack import LoopbackOcrServer, db_rows, namespaced_pipeline

FIELDS = ("invoice number", "date", "total")
HUNYUAN = dialect("hunyuan")
EXTRACT = HUNYUAN.sampling(EngineTask("extract", TaskParams(fields=FIELDS)))
SELLER = HUNYUAN.sampling(EngineTask("extract", TaskParams(fields=("seller",))))
PARSE = HUNYUAN.sampling(EngineTask("doc_parse", None))
TABLE_MD = "# Invoice INV-7\n\n<table><tr><td>Item</td><td>Price</td></tr><tr><td>Pen</td><td>3.00</td></tr></table>"


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
    sent = server.received[-1]
    assert sent["prompt"] == "提取图片中的: ['invoice number','date','total'] 的字段内容，并按照 JSON 格式返回。"
    assert (sent["temperature"], sent["top_p"], sent["repetition_penalty"]) == (0.0, 1.0, 1.08)
    assert sent["max_tokens"] == EXTRACT.max_tokens
    rows = db_rows("SELECT position, field_name, value FROM result_fields WHERE cache_key = %s ORDER BY position",
                   doc.cache_key)
    assert [(r["position"], r["field_name"], r["value"]) for r in rows] == [
        (0, "invoice number", "INV-7"), (1, "date", "2026-12-01"), (2, "total", None)]

    # the same fields in another order: the same cache key, answered from the cache
    [again] = await vlm_pipeline.run([(image, "inv-again.png")], task="extract",
                                     task_params=TaskParams(fields=("total", "invoice number", "date")))
    assert again.status == "ok" and again.cache_hit and again.cache_key == doc.cache_key
    assert again.fields == doc.fields
    assert server.posts == posts + 1  # no engine call


async def test_doc_parse_and_ocr_of_one_image_are_two_keys_and_two_calls(vlm_pipeline, server):
    image = text_image(["PARSE ME 9911"])
    posts = server.posts
    parsed, spotted = await vlm_pipeline.run([(image, "p.png")], task="doc_parse") + \
        await vlm_pipeline.run([(image, "p.png")])
    assert parsed.status == "ok" and parsed.markdown == TABLE_MD and parsed.text == TABLE_MD
    assert server.received[-2]["prompt"] == PARSE.prompt
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
