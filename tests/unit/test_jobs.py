"""Jobs: the control events, the progress arithmetic, the report rows and totals (pure logic)."""

from __future__ import annotations

import io

import orjson
import pytest
from pydantic import ValidationError

from schemas.errors import ErrorCode
from schemas.events import ErrorInfo, Line, ResultDocument, SubmitEvent
from schemas.jobs import JobEvent, job_completion_event_id
from services.common.job_report import SummaryBuilder, report_columns, write_rows
from services.common.jobs import JobRow, progress_of, request_row

BOX = [[0, 0], [10, 0], [10, 10], [0, 10]]


def job(**kw) -> JobRow:
    base = dict(job_id="j1", name="n", task=None, task_params_json=None, webhook_url=None, api_key_id=None,
                created_at_ms=1_000, expected=None, closed_at_ms=None, completed_at_ms=None, completion_json=None,
                completion_sent=0)
    return JobRow(**{**base, **kw})


def test_a_close_needs_its_count_and_a_job_id_follows_the_request_id_rule():
    assert JobEvent(action="close", job_id="a-b.c:1", expected=0).expected == 0
    with pytest.raises(ValidationError, match="needs `expected`"):
        JobEvent(action="close", job_id="j")
    for bad in ("", "..", "a b", "x" * 65):
        with pytest.raises(ValidationError):
            JobEvent(action="create", job_id=bad)
    with pytest.raises(ValidationError):
        SubmitEvent(image_b64="", job_id="no spaces")
    assert SubmitEvent(image_b64="", job_id="j1").job_id == "j1"
    assert job_completion_event_id("j1") == job_completion_event_id("j1") != job_completion_event_id("j2")
    assert len(job_completion_event_id("j1")) == 32


def test_progress_sums_the_groups_and_derives_rate_and_eta():
    groups = [
        {"status": "ok", "error_code": None, "n": 6, "hits": 2, "pages": 6, "line_count": 12, "chars": 100,
         "first": 2_000, "last": 4_000},
        {"status": "error", "error_code": "empty_input", "n": 1, "hits": 0, "pages": 1, "line_count": 0, "chars": 0,
         "first": 1_500, "last": 1_500},
        {"status": "error", "error_code": "corrupt_image", "n": 1, "hits": 0, "pages": 1, "line_count": 0,
         "chars": 0, "first": 3_000, "last": 3_000},
    ]
    p = progress_of(job(expected=16, closed_at_ms=5_000), groups)
    assert (p.state, p.total, p.done, p.ok, p.failed, p.cache_hits, p.pages, p.lines, p.chars) == (
        "closed", 16, 8, 6, 2, 2, 8, 12, 100)
    assert p.failed_by_code == {"corrupt_image": 1, "empty_input": 1}
    assert (p.first_completed_at_ms, p.last_completed_at_ms) == (1_500, 4_000)
    assert p.rate_per_s == round(8 / 3.0, 3)  # 8 done from creation (1.0 s) to the last completion (4.0 s)
    assert p.eta_s == round(8 / p.rate_per_s, 1)
    assert progress_of(job(), []).model_dump(include={"state", "done", "rate_per_s", "eta_s"}) == {
        "state": "open", "done": 0, "rate_per_s": None, "eta_s": None}
    assert progress_of(job(expected=8, completion_json="{}"), groups).model_dump(include={"state", "eta_s"}) == {
        "state": "completed", "eta_s": 0.0}


def _doc(rid: str, **kw) -> ResultDocument:
    return ResultDocument(request_id=rid, job_id="j1", completed_at_ms=9, submitted_at_ms=1, **kw)


def test_a_request_row_counts_lines_characters_and_mean_confidence():
    ok = _doc("r1", status="ok", text="AB\nCDE", filename="a.png", cache_hit=True, fields={"total": "3"},
              lines=[Line(text="AB", box=BOX, confidence=0.5), Line(text="CDE", box=BOX, confidence=1.0)],
              timings_ms={"total": 20.0, "inference": 7.5})
    row = request_row(ok)
    assert row[:13] == ("j1", "r1", "ok", None, 1, 1, 2, 6, 0.75, "a.png", 20.0, 7.5, '{"total":20.0,"inference":7.5}')
    assert row[13:] == ('{"total":"3"}', 1, 9)
    err = request_row(_doc("r2", status="error", error=ErrorInfo(code=ErrorCode.EMPTY_INPUT, message="empty")))
    assert err[2:9] == ("error", "empty_input", 0, 1, 0, 0, None)


def test_report_rows_stream_to_csv_and_jsonl_with_a_column_per_field_and_totals():
    rows = [
        {"request_id": "r1", "filename": "a.png", "status": "ok", "error_code": None, "pages": 1, "line_count": 2,
         "char_count": 6, "mean_confidence": 0.75, "cache_hit": 0, "total_ms": 20.0, "inference_ms": 7.5,
         "timings_json": '{"total": 20.0, "inference": 7.5}', "fields_json": '{"total": "3", "date": null}'},
        {"request_id": "r2", "filename": "b.jpg", "status": "error", "error_code": "empty_input", "pages": 1,
         "line_count": 0, "char_count": 0, "mean_confidence": None, "cache_hit": 1, "total_ms": 40.0,
         "inference_ms": None, "timings_json": '{"total": 40.0}', "fields_json": None},
    ]
    fcsv, fjsonl, acc = io.StringIO(), io.StringIO(), SummaryBuilder()
    assert write_rows(iter(rows), ["total", "date"], {"csv": fcsv, "jsonl": fjsonl}, acc.add) == 2
    cols = report_columns(["total", "date"])
    lines = fcsv.getvalue().splitlines()
    assert lines[0] == ",".join(cols) and cols[-2:] == ["field:total", "field:date"]
    assert lines[1] == "a.png,r1,ok,,1,2,6,0.75,false,20.0," + ",,,,,,,," + "7.5,,,,,3,"  # 13 stage times
    assert lines[2].startswith("b.jpg,r2,error,empty_input,1,0,0,,true,40.0,")
    first = orjson.loads(fjsonl.getvalue().splitlines()[0])
    assert list(first) == cols and first["field:total"] == "3" and first["field:date"] is None
    s = acc.summary()
    assert (s.requests, s.by_status, s.by_error_code, s.engine_ms, s.cache_hit_rate) == (
        2, {"error": 1, "ok": 1}, {"empty_input": 1}, 7.5, 0.5)
    assert s.latency_ms == {"p50": 30.0, "p95": 39.0, "p99": 39.8}
