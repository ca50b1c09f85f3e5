"""The shared builders of services/common/results/build.py: a cache hit's result event (dedup and the
HTTP door), and a request's final document (the sink and the door's cache answer)."""

from __future__ import annotations

import pytest

from schemas.errors import ErrorCode
from schemas.events import OcrOutput, RequestEvent, ResultEvent
from schemas.keys import CacheGeneration
from schemas.reading import ErrorInfo, Line, Page
from services.common.results.build import cache_hit_event, document_output, ocr_output, result_document

SHA = "ab" * 32
OTHER = "cd" * 32
GEN = CacheGeneration(engine="rapidocr", model="PP-OCRv4-ch", model_revision="rev-1", task="ocr", preprocess_version=2)
KEY = f"{GEN.gen_id}:{SHA}"
URI = f"s3://bucket/results/{SHA}/{GEN.gen_id}.json"
BOX = [[0.0, 0.0], [10.0, 0.0], [10.0, 5.0], [0.0, 5.0]]


def request(**kw) -> RequestEvent:
    base = dict(request_id="r1", content_sha256=SHA, image_uri=f"s3://bucket/images/{SHA}", size_bytes=10,
                width=640, height=480, submitted_at_ms=1_000, filename="scan.png", source="mail",
                callback_url="https://hooks.example/done", api_key_id="key-1", metadata={"order": "42"},
                timings_ms={"ingest": 1.5, "dedup": 0.5})
    return RequestEvent(**{**base, **kw})


def line(text: str, page: int = 1) -> Line:
    return Line(text=text, box=BOX, confidence=0.9, page=page)


PAGES = [Page(index=1, width=300, height=200), Page(index=2, width=310, height=210)]


def test_an_exact_hit_points_at_the_stored_output_and_names_who_computed_it():
    req = request()
    ev = cache_hit_event(req, KEY, "redis", GEN, result_uri=URI)
    assert (ev.status, ev.cache_hit, ev.cache_tier, ev.cache_key, ev.result_uri) == ("ok", True, "redis", KEY, URI)
    assert (ev.engine, ev.model, ev.model_revision, ev.cacheable) == ("rapidocr", "PP-OCRv4-ch", "rev-1", True)
    assert ev.request is req and ev.lines == [] and ev.pages == [] and ev.near_duplicate_of is None
    # a settlement names who computed the result: that wins over the generation
    ev = cache_hit_event(req, KEY, "single_flight", GEN, result_uri=URI, engine="vllm", model="tencent/HunyuanOCR",
                         model_revision="main", cacheable=False)
    assert (ev.cache_tier, ev.engine, ev.model, ev.model_revision, ev.cacheable) == (
        "single_flight", "vllm", "tencent/HunyuanOCR", "main", False)
    # an older settlement without them: the generation's
    ev = cache_hit_event(req, KEY, "settled", GEN, result_uri=URI, engine=None, model=None, model_revision=None)
    assert (ev.engine, ev.model, ev.model_revision) == ("rapidocr", "PP-OCRv4-ch", "rev-1")


def test_a_near_hit_carries_the_rescaled_lines_and_no_uri():
    ev = cache_hit_event(request(), KEY, "near", GEN, near_duplicate_of=OTHER, pages=[Page(index=1, width=64, height=32)],
                         lines=[line("Total 9.50")], warnings=["truncated_max_tokens"])
    assert (ev.cache_tier, ev.near_duplicate_of, ev.result_uri, ev.engine) == ("near", OTHER, None, "rapidocr")
    assert [ln.text for ln in ev.lines] == ["Total 9.50"] and (ev.pages[0].width, ev.pages[0].height) == (64, 32)
    assert ev.warnings == ["truncated_max_tokens"]


def test_a_hit_of_the_wrong_kind_is_refused():
    with pytest.raises(ValueError, match="'redis' hit takes result_uri"):
        cache_hit_event(request(), KEY, "redis", GEN)
    with pytest.raises(ValueError, match="'near' hit takes near_duplicate_of"):
        cache_hit_event(request(), KEY, "near", GEN, result_uri=URI)
    with pytest.raises(ValueError):
        cache_hit_event(request(), KEY, "lru", GEN, result_uri=URI, near_duplicate_of=OTHER)


def computed(req: RequestEvent, **kw) -> ResultEvent:
    return ResultEvent(request=req, cache_key=KEY, status="ok", engine="rapidocr", model="PP-OCRv4-ch",
                       model_revision="rev-1", pages=PAGES, lines=[line("Hello"), line("world"), line("p2", 2)],
                       warnings=["truncated_repetition"], **kw)


def test_the_stored_output_of_a_computed_result():
    out = ocr_output(computed(request()))
    assert (out.cache_key, out.content_sha256, out.engine, out.model, out.model_revision, out.task) == (
        KEY, SHA, "rapidocr", "PP-OCRv4-ch", "rev-1", "ocr")
    assert out.text == "Hello\nworld\n\np2" and out.pages == PAGES and out.warnings == ["truncated_repetition"]


def test_a_computed_result_becomes_its_document():
    req = request()
    ev = computed(req)
    doc = result_document(req, ev, ocr_output(ev), cache_hit=False, stored_uri=URI, completed_at_ms=1_250,
                          trace_id="ab" * 16, timings_ms={"queue_sink": 2.0, "write": 3.25})
    assert (doc.request_id, doc.status, doc.error, doc.cache_hit, doc.cache_tier) == ("r1", "ok", None, False, None)
    assert (doc.content_sha256, doc.cache_key, doc.result_uri) == (SHA, KEY, URI)
    assert (doc.width, doc.height) == (300, 200)  # page 1's, not the request's
    assert doc.text == "Hello\nworld\n\np2" and len(doc.lines) == 3 and doc.warnings == ["truncated_repetition"]
    assert (doc.task, doc.source, doc.filename, doc.callback_url, doc.api_key_id, doc.metadata) == (
        "ocr", "mail", "scan.png", "https://hooks.example/done", "key-1", {"order": "42"})
    assert (doc.submitted_at_ms, doc.completed_at_ms, doc.trace_id) == (1_000, 1_250, "ab" * 16)
    # the request's timings, then the stage's, then total = completed - submitted
    assert doc.timings_ms == {"ingest": 1.5, "dedup": 0.5, "queue_sink": 2.0, "write": 3.25, "total": 250.0}
    assert list(doc.timings_ms) == ["ingest", "dedup", "queue_sink", "write", "total"]


def test_a_cache_hit_document_keeps_its_tier_and_the_outputs_near_duplicate():
    req = request(timings_ms={"http": 4.5})
    ev = cache_hit_event(req, KEY, "redis", GEN, result_uri=URI)
    output = OcrOutput(cache_key=KEY, content_sha256=SHA, engine="rapidocr", model="PP-OCRv4-ch", model_revision="rev-1",
                       task="ocr", pages=[Page(index=1, width=64, height=32)], lines=[line("copy")], text="copy",
                       near_duplicate_of=OTHER)
    doc = result_document(req, ev, output, cache_hit=True, stored_uri=URI, completed_at_ms=1_004, trace_id=None,
                          total_ms=4.5)
    assert (doc.cache_hit, doc.cache_tier, doc.result_uri, doc.near_duplicate_of) == (True, "redis", URI, OTHER)
    assert (doc.width, doc.height, doc.text) == (64, 32, "copy")
    assert doc.timings_ms == {"http": 4.5, "total": 4.5}  # the door's own measure, not completed - submitted
    # the same event completed as no hit (the document vanished): no tier
    assert result_document(req, ev, output, cache_hit=False, stored_uri=URI, completed_at_ms=1_004,
                           trace_id=None).cache_tier is None


def test_an_error_document_has_no_content_and_the_requests_size():
    req = request(timings_ms={})
    err = ErrorInfo(code=ErrorCode.ENGINE_ERROR, message="the engine failed")
    ev = ResultEvent(request=req, cache_key=KEY, status="error", error=err, warnings=["truncated_max_tokens"])
    doc = result_document(req, ev, None, cache_hit=False, stored_uri=URI, completed_at_ms=900, trace_id=None)
    assert (doc.status, doc.error, doc.result_uri, doc.lines, doc.text) == ("error", err, None, [], "")
    assert (doc.width, doc.height, doc.warnings) == (640, 480, ["truncated_max_tokens"])
    assert doc.timings_ms == {"total": 0.0}  # completed before submitted (clock skew): never negative
    # an ok event's error field is not copied
    ok = ResultEvent(request=req, status="ok", error=err)
    assert result_document(req, ok, None, cache_hit=False, stored_uri=None, completed_at_ms=1_000,
                           trace_id=None).error is None


def test_a_result_not_stored_under_its_key_has_no_result_uri():
    req = request()
    ev = computed(req, cacheable=False)  # another generation's: stored under the request, not the key
    assert result_document(req, ev, ocr_output(ev), cache_hit=False, stored_uri=URI, completed_at_ms=1_000,
                           trace_id=None).result_uri is None
    keyless = ResultEvent(request=req, status="ok", pages=PAGES)
    assert result_document(req, keyless, None, cache_hit=False, stored_uri=URI, completed_at_ms=1_000,
                           trace_id=None).result_uri is None


def test_a_waiter_gets_its_own_request_fields_with_the_holders_result():
    holder = request()
    waiter = request(request_id="w1", filename="copy.png", metadata={}, submitted_at_ms=1_100, timings_ms={"dedup": 9.0})
    ev = computed(holder)
    doc = result_document(waiter, ev, ocr_output(ev), cache_hit=True, stored_uri=URI, completed_at_ms=1_400,
                          trace_id=None, timings_ms={"queue_sink": 0.0})
    assert (doc.request_id, doc.filename, doc.metadata, doc.submitted_at_ms) == ("w1", "copy.png", {}, 1_100)
    assert doc.timings_ms == {"dedup": 9.0, "queue_sink": 0.0, "total": 300.0}


def test_a_documents_whole_output_for_the_row_bound():
    req = request()
    ev = computed(req)
    doc = result_document(req, ev, ocr_output(ev), cache_hit=False, stored_uri=None, completed_at_ms=1_000,
                          trace_id=None)
    whole = document_output(doc)
    assert (whole.cache_key, whole.content_sha256, whole.engine, whole.text, whole.pages) == (
        KEY, SHA, "rapidocr", "Hello\nworld\n\np2", PAGES)
    bare = document_output(doc.model_copy(update={"cache_key": None, "engine": None, "model": None}))
    assert (bare.cache_key, bare.engine, bare.model) == ("", "", "")


def test_an_extract_result_carries_its_fields_and_parameters_and_text_is_their_json():
    from schemas.tasks import TaskParams

    req = request(task="extract", task_params=TaskParams(fields=("total", "date", "seller")))
    ev = ResultEvent(request=req, cache_key=KEY, status="ok", engine="openai", model="HunyuanOCR",
                     model_revision="rev-1", pages=PAGES[:1],
                     fields={"total": "97.50 EUR", "date": "2024-03-01", "seller": None})
    out = ocr_output(ev)
    assert out.task == "extract" and out.task_params == TaskParams(fields=("total", "date", "seller"))
    assert out.fields == {"total": "97.50 EUR", "date": "2024-03-01", "seller": None}
    assert out.text == '{"total":"97.50 EUR","date":"2024-03-01","seller":null}' and out.lines == []
    doc = result_document(req, ev, out, cache_hit=False, stored_uri=URI, completed_at_ms=1_250, trace_id=None)
    assert doc.fields == out.fields and list(doc.fields) == ["total", "date", "seller"]
    assert doc.task_params == req.task_params and doc.text == out.text and doc.raw_output is None
    assert document_output(doc).fields == out.fields and document_output(doc).task_params == req.task_params


def test_a_stored_extraction_answers_only_the_fields_asked_in_the_order_asked():
    """A hit of tier ``fields`` (a stored extraction of more fields) and a hit of the same fields
    in another order: the document lists exactly the request's fields, values as stored, and
    ``text`` is their JSON; the stored output is untouched."""
    from schemas.tasks import TaskParams
    from services.common.results.build import answer_fields

    stored_req = request(task="extract", task_params=TaskParams(fields=("seller", "total", "date")))
    ev = ResultEvent(request=stored_req, cache_key=KEY, status="ok", engine="openai", model="HunyuanOCR",
                     model_revision="rev-1", fields={"seller": "ACME", "total": "97.50 EUR", "date": None})
    out = ocr_output(ev)
    sub = request(request_id="r2", task="extract", task_params=TaskParams(fields=("date", "seller")))
    hit = cache_hit_event(sub, KEY, "fields", GEN, result_uri=URI)
    doc = result_document(sub, hit, out, cache_hit=True, stored_uri=URI, completed_at_ms=1_250, trace_id=None)
    assert list(doc.fields.items()) == [("date", None), ("seller", "ACME")]
    assert doc.text == '{"date":null,"seller":"ACME"}' and doc.cache_tier == "fields" and doc.cache_key == KEY
    assert doc.task_params == TaskParams(fields=("date", "seller")) and doc.result_uri == URI
    assert list(out.fields) == ["seller", "total", "date"]  # the stored answer as it was
    again = request(request_id="r3", task="extract", task_params=TaskParams(fields=("total", "date", "seller")))
    assert list(answer_fields(again, out.fields).items()) == [("total", "97.50 EUR"), ("date", None), ("seller", "ACME")]
    assert answer_fields(stored_req, out.fields) is None  # the same order: the stored text stands
    assert answer_fields(request(), out.fields) is None and answer_fields(sub, None) is None


@pytest.mark.parametrize("task,slot,value", [("doc_parse", "markdown", "# Invoice\n\n<table><tr><td>1</td></tr></table>"),
                                             ("table", "html", "<table><tr><td>a</td></tr></table>"),
                                             ("formula", "latex", "E = mc^2"),
                                             ("chart", "markdown", "| x | y |\n|---|---|\n| 1 | 2 |")])
def test_a_text_task_fills_its_slot_and_text(task, slot, value):
    req = request(task=task)
    ev = ResultEvent(request=req, cache_key=KEY, status="ok", engine="openai", model="m", model_revision="r",
                     **{slot: value})
    out = ocr_output(ev)
    assert getattr(out, slot) == value and out.text == value
    assert getattr(result_document(req, ev, out, cache_hit=False, stored_uri=URI, completed_at_ms=2_000,
                                   trace_id=None), slot) == value


def test_a_translation_is_its_text():
    from schemas.tasks import TaskParams

    req = request(task="translate", task_params=TaskParams(target_lang="en"))
    ev = ResultEvent(request=req, cache_key=KEY, status="ok", engine="openai", model="m", model_revision="r",
                     translation="Total: 97.50 EUR", lines=[line("Summe: 97,50 EUR")])
    out = ocr_output(ev)
    assert (out.translation, out.text, out.task_params.target_lang) == ("Total: 97.50 EUR", "Total: 97.50 EUR", "en")


def test_an_unparsable_answer_keeps_its_raw_output_in_the_document_and_nothing_is_stored():
    from schemas.tasks import TaskParams

    req = request(task="extract", task_params=TaskParams(fields=("total",)))
    ev = ResultEvent(request=req, cache_key=KEY, status="error", raw_output="I can see a receipt.",
                     error=ErrorInfo(code=ErrorCode.UNPARSABLE_OUTPUT, message="not JSON"))
    doc = result_document(req, ev, None, cache_hit=False, stored_uri=None, completed_at_ms=1_250, trace_id=None)
    assert (doc.status, doc.error.code, doc.raw_output) == ("error", ErrorCode.UNPARSABLE_OUTPUT, "I can see a receipt.")
    assert doc.result_uri is None and doc.fields is None and doc.text == ""
    assert doc.task_params == TaskParams(fields=("total",))


def test_a_task_document_over_the_row_bound_leaves_its_slot_out_and_cuts_text():
    from schemas.events import ResultDocument
    from services.common.results.rows import bound_document

    doc = ResultDocument(request_id="r1", status="ok", task="doc_parse", markdown="x" * 5000, text="x" * 5000)
    bounded, raw = bound_document(doc, 3000)
    assert bounded.markdown is None and bounded.text_truncated and len(raw.encode()) <= 3000
    assert bounded.text == "x" * len(bounded.text) and len(bounded.text) > 2000
    assert bound_document(doc, 20_000) == (doc, doc.model_dump_json(by_alias=True))
