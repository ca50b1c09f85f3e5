"""``ocrstream status``'s pure parts: what it prints of a result document, and its exit codes."""

from schemas.errors import ErrorCode
from schemas.events import ResultDocument
from schemas.reading import ErrorInfo, Line
from schemas.tasks import TaskParams
from services.cli.status import Lookup, exit_code, not_final_line, summary_lines, timings_line
from services.common.requests.acceptance import Accepted

RID = "3262c1a774be43cda107e650d1ddcbc5"
TIMINGS = {"total": 19506.4, "queue_ingest": 2.2, "ingest": 14.0, "inference": 803.5, "write": 4.6}


def line(text: str, page: int = 1) -> Line:
    return Line(text=text, confidence=0.9, box=[[0, 0], [10, 0], [10, 10], [0, 10]], page=page)


def test_an_ok_ocr_result_reads_as_labelled_lines():
    doc = ResultDocument(request_id=RID, status="ok", filename="sroie_007.jpg", cache_hit=True, cache_tier="redis",
                         lines=[line("tan chay yee"), line("No. 343")], text="tan chay yee\nNo. 343",
                         timings_ms=TIMINGS)
    assert summary_lines(doc) == [
        f"request:  {RID}",
        "file:     sroie_007.jpg",
        "status:   ok (cache hit: redis)",
        "task:     ocr",
        "lines:    2",
        "timings:  19506 ms in all: queue_ingest 2, ingest 14, inference 804, write 5",
    ]


def test_an_error_shows_its_code_and_message_and_no_line_count():
    doc = ResultDocument(request_id=RID, status="error", filename="notes.txt",
                         timings_ms={"total": 177.0, "ingest": 162.0},
                         error=ErrorInfo(code=ErrorCode.UNSUPPORTED_FORMAT, message="not an image\x1b[2J\nsecond line"))
    assert summary_lines(doc) == [
        f"request:  {RID}",
        "file:     notes.txt",
        "status:   error",
        "error:    unsupported_format: not an image␛[2J second line",
        "task:     ocr",
        "timings:  177 ms in all: ingest 162",
    ]


def test_a_partial_document_names_its_failed_pages_and_a_page_its_document():
    doc = ResultDocument(request_id="D", status="partial", page_count=7, failed_pages=[2, 5],
                         lines=[line("p1"), line("p3", 3)], timings_ms={"total": 40.0})
    assert summary_lines(doc)[1:] == [
        "status:   partial", "task:     ocr", "pages:    7; pages 2, 5 failed", "lines:    2",
        "timings:  40 ms in all"]
    one = doc.model_copy(update={"failed_pages": [3]})
    assert summary_lines(one)[3] == "pages:    7; page 3 failed"
    page = ResultDocument(request_id="D:p3", status="ok", document_id="D", page_number=3, page_count=7,
                          lines=[line("p3", 3)], timings_ms={})
    assert summary_lines(page)[1:] == [
        "status:   ok", "task:     ocr", "document: page 3 of 7 of D (ocrstream status D)", "lines:    1",
        "timings:  -"]


def test_a_tasks_parameters_are_shown_and_its_line_count_only_when_it_has_lines():
    extract = ResultDocument(request_id=RID, status="ok", task="extract", fields={"date": "1 May", "total": None},
                             task_params=TaskParams(fields=("date", "total")), timings_ms={"total": 90.0})
    assert summary_lines(extract)[2:] == ["task:     extract (fields: date, total)", "timings:  90 ms in all"]
    translate = ResultDocument(request_id=RID, status="ok", task="translate", translation="hello",
                               task_params=TaskParams(target_lang="en"), lines=[line("bonjour")])
    assert summary_lines(translate)[2:4] == ["task:     translate (to: en)", "lines:    1"]


def test_a_cut_summary_says_where_the_whole_result_is_and_warnings_are_shown():
    doc = ResultDocument(request_id=RID, status="ok", lines=[line("a")], lines_omitted=4999, text_truncated=True,
                         result_uri="s3://b/results/x.json", warnings=["page 1: rotated 90 degrees"])
    assert summary_lines(doc)[3:] == [
        "lines:    5000 (4999 not in the stored summary; all at s3://b/results/x.json)",
        "timings:  -",
        "note:     the text below is cut at the database row bound; the whole result is at s3://b/results/x.json",
        "warning:  page 1: rotated 90 degrees"]


def test_timings_are_in_pipeline_order_with_other_keys_after():
    assert timings_line({"write": 1.0, "http": 5.0, "total": 9.0, "queue_ingest": 2.0}) == (
        "9 ms in all: queue_ingest 2, write 1, http 5")
    assert timings_line({"ingest": 3.0}) == "ingest 3 (ms)"
    assert timings_line({}) == "-"


def test_each_state_has_its_own_exit_code_and_line():
    ok = ResultDocument(request_id=RID, status="ok")
    assert [exit_code(Lookup(doc=ok)), exit_code(Lookup(doc=ok.model_copy(update={"status": "error"}))),
            exit_code(Lookup(doc=ok.model_copy(update={"status": "partial"}))), exit_code(Lookup(unknown=True)),
            exit_code(Lookup(accepted=Accepted("claim"))),
            exit_code(Lookup(unavailable="Redis down"))] == [0, 1, 1, 2, 3, 4]
    assert not_final_line(RID, Lookup(accepted=Accepted("marker"))) == f"{RID}: pending: accepted, not final yet"
    assert not_final_line("D:p2", Lookup(accepted=Accepted("page", document_id="D", page_number=2))) == (
        "D:p2: pending: page 2 of the document D, not final yet (ocrstream status D)")
    assert not_final_line("typo", Lookup(unknown=True)) == (
        "error: no request 'typo': none was accepted under this id (a request sent to ocr.submit is known once "
        "ingest has read it)")
    assert not_final_line("j1", Lookup(unknown=True, job=True)) == (
        "error: no request 'j1': it is a job's id (ocrstream job status j1)")
    assert not_final_line("x\x1b", Lookup(unavailable="MariaDB did not answer")) == (
        "error: the state of 'x\\x1b' cannot be told: MariaDB did not answer")
