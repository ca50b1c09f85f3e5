"""Jobs: the control events, the progress arithmetic, the report rows and totals (pure logic)."""

from __future__ import annotations

import io

import orjson
import pytest
from pydantic import ValidationError

from schemas.errors import ErrorCode
from schemas.events import ResultDocument, SubmitEvent
from schemas.jobs import JobEvent, job_completion_event_id
from schemas.reading import ErrorInfo, Line
from services.common.jobs.report import SummaryBuilder, report_columns, write_rows
from services.common.jobs.store import JobRow, progress_of, request_row

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
         "timings_json": '{"total": 20.0, "inference": 7.5, "queue_dedup": 3.006591796875}',
         "fields_json": '{"total": "3", "date": null}'},
        {"request_id": "r2", "filename": "b.jpg", "status": "error", "error_code": "empty_input", "pages": 1,
         "line_count": 0, "char_count": 0, "mean_confidence": None, "cache_hit": 1, "total_ms": 40.0,
         "inference_ms": None, "timings_json": '{"total": 40.0}', "fields_json": None},
    ]
    fcsv, fjsonl, acc = io.StringIO(), io.StringIO(), SummaryBuilder()
    assert write_rows(iter(rows), ["total", "date"], {"csv": fcsv, "jsonl": fjsonl}, acc.add) == 2
    cols = report_columns(["total", "date"])
    lines = fcsv.getvalue().splitlines()
    assert lines[0] == ",".join(cols) and cols[-2:] == ["field:total", "field:date"]
    # 13 stage times, rounded to 0.001 ms (queue_dedup 3.006591796875 -> 3.007)
    assert lines[1] == "a.png,r1,ok,,1,2,6,0.75,false,20.0," + ",,3.007,,,,,,," + "7.5,,,,3,"
    assert lines[2].startswith("b.jpg,r2,error,empty_input,1,0,0,,true,40.0,")
    first = orjson.loads(fjsonl.getvalue().splitlines()[0])
    assert list(first) == cols and first["field:total"] == "3" and first["field:date"] is None
    s = acc.summary()
    assert (s.requests, s.by_status, s.by_error_code, s.engine_ms, s.cache_hit_rate) == (
        2, {"error": 1, "ok": 1}, {"empty_input": 1}, 7.5, 0.5)
    assert s.latency_ms == {"p50": 30.0, "p95": 39.0, "p99": 39.8}


# -- the jobs stage's handler over the jobs tables in memory ---------------------------------------
import asyncio  # noqa: E402

from aiokafka import ConsumerRecord  # noqa: E402

from schemas.events import CompletedEvent  # noqa: E402
from schemas.jobs import JobCompletedEvent, JobSummary  # noqa: E402
from services.common.codec import dumps  # noqa: E402
from services.common.jobs.store import is_page  # noqa: E402
from services.common.records import RecordParser  # noqa: E402
from services.jobs.handler import JobsHandler  # noqa: E402
from services.jobs.settings import JobsSettings  # noqa: E402

JS = JobsSettings()


class MemoryJobs:
    """The jobs tables in memory, with the store's rules: first create/close wins, a request counts once."""

    def __init__(self):
        self.rows: dict[str, dict] = {}
        self.requests: dict[tuple[str, str], ResultDocument] = {}
        self.sent: list[str] = []

    async def record(self, events, docs):
        for ev in events:
            row = self.rows.setdefault(ev.job_id, {})
            if ev.action == "create":
                row.setdefault("name", ev.name)
            else:
                row.setdefault("expected", ev.expected)
        for d in docs:
            self.rows.setdefault(d.job_id, {})
            self.requests.setdefault((d.job_id, d.request_id), d)

    async def job(self, job_id):
        r = self.rows.get(job_id)
        return None if r is None else job(job_id=job_id, name=r.get("name"), expected=r.get("expected"),
                                          completion_json=r.get("completion"), completion_sent=int(r.get("sent", 0)))

    async def final_count(self, job_id):
        return sum(1 for j, _ in self.requests if j == job_id)

    async def progress(self, job_id):
        docs = [d for (j, _), d in self.requests.items() if j == job_id]
        groups = [{"status": d.status, "error_code": d.error.code.value if d.error else None, "n": 1, "hits": 0,
                   "pages": 1, "line_count": 0, "chars": 0, "first": d.completed_at_ms, "last": d.completed_at_ms}
                  for d in docs]
        return progress_of(await self.job(job_id), groups)

    async def store_completion(self, job_id, raw, at):
        self.rows[job_id].setdefault("completion", raw.decode())
        return self.rows[job_id]["completion"]

    async def mark_sent(self, ids):
        for j in ids:
            self.rows[j]["sent"] = True
            self.sent.append(j)


async def _report(db, store, job):
    return JobSummary(requests=0, by_status={}, by_error_code={}, latency_ms={}, engine_ms=0.0, cache_hit_rate=0.0,
                      pages=0, lines=0, chars=0), {"csv": f"s3://b/reports/{job.job_id}/report.csv"}


def _records(values: list[tuple[str, bytes]]):
    dec = RecordParser({JS.topics.jobs: JobEvent, JS.topics.completed: CompletedEvent})
    return [dec(ConsumerRecord(t, 0, i, 0, 0, None, v, None, 0, 0, [])) for i, (t, v) in enumerate(values)]


def _completion(rid: str, job_id: str | None, at: int, **kw) -> tuple[str, bytes]:
    doc = ResultDocument(request_id=rid, status="ok", job_id=job_id, completed_at_ms=at, **kw)
    return JS.topics.completed, dumps(CompletedEvent(event_id=rid, request_id=rid, result=doc))


def test_the_handler_counts_each_request_once_and_sends_one_completion_only_when_closed_and_full():
    mem = MemoryJobs()
    h = JobsHandler(JS, store=None, db=None, jobs=mem, report=_report)
    ctl = lambda **kw: (JS.topics.jobs, dumps(JobEvent(**kw)))  # noqa: E731
    out = asyncio.run(h.handle(_records([ctl(action="create", job_id="j1", name="n"), _completion("r1", "j1", 10),
                                         _completion("r1", "j1", 11), _completion("x", None, 12)])))
    assert out == [] and len(mem.requests) == 1  # r1 twice counts once; no job: not counted
    out = asyncio.run(h.handle(_records([ctl(action="close", job_id="j1", expected=2)])))
    assert out == []  # closed, one of two final
    out = asyncio.run(h.handle(_records([_completion("r2", "j1", 20)])))
    [msg] = out
    assert (msg.topic, msg.key) == (JS.topics.job_completed, "j1")
    ev = JobCompletedEvent.model_validate_json(msg.value)
    assert (ev.event_id, ev.completed_at_ms, ev.progress.state, ev.progress.done, ev.name) == (
        job_completion_event_id("j1"), 20, "completed", 2, "n")
    # not acknowledged yet (a crash here): the replay sends the same bytes
    again = asyncio.run(h.handle(_records([_completion("r2", "j1", 20)])))
    assert [m.value for m in again] == [msg.value]
    asyncio.run(h.after_produce())
    assert mem.sent == ["j1"]
    # acknowledged: a late duplicate sends nothing
    assert asyncio.run(h.handle(_records([_completion("r1", "j1", 30)]))) == []


def test_a_page_of_a_document_is_not_a_request_of_its_job_and_a_bad_event_goes_to_the_dlq_at_once():
    page = ResultDocument(request_id="p1", status="ok", job_id="j1", document_id="d1", page_number=3, page_count=4)
    assert is_page(page) and not is_page(ResultDocument(request_id="d1", status="ok"))
    mem = MemoryJobs()
    h = JobsHandler(JS, store=None, db=None, jobs=mem, report=_report)
    raw = dumps(CompletedEvent(event_id="p1", request_id="p1", result=page))
    assert asyncio.run(h.handle(_records([(JS.topics.completed, raw)]))) == []
    assert mem.requests == {} and mem.rows == {}  # not counted
    [bad] = _records([(JS.topics.jobs, b'{"schema": "ocr.job.v1", "action": "close", "job_id": "j1"}')])
    out = asyncio.run(h.undecodable(bad, bad.error))
    assert [m.topic for m in out] == [JS.topics.dlq]
    assert orjson.loads(out[0].value)["error_code"] == "invalid_request"


def test_a_close_beyond_the_int_column_and_an_out_of_range_time_do_not_validate_and_go_to_the_dlq():
    from schemas.jobs import EPOCH_MS_MAX, JOB_EXPECTED_MAX

    assert JOB_EXPECTED_MAX == 2**31 - 1  # MariaDB's INT (jobs.expected)
    assert JobEvent(action="close", job_id="j1", expected=JOB_EXPECTED_MAX).expected == 2147483647
    assert JobEvent(action="create", job_id="j1", at_ms=EPOCH_MS_MAX).at_ms == 253_402_300_799_999
    for bad in ({"expected": 2**31}, {"expected": 10**30}, {"expected": 2, "at_ms": -1},
                {"expected": 2, "at_ms": EPOCH_MS_MAX + 1}):
        with pytest.raises(ValidationError):
            JobEvent(action="close", job_id="j1", **bad)
    # a producer's event that does not validate ends in the DLQ at once: the stage reads on, nothing is written
    h = JobsHandler(JS, store=None, db=None, jobs=MemoryJobs(), report=_report)
    huge = b'{"schema": "ocr.job.v1", "action": "close", "job_id": "j1", "expected": 2147483648}'
    early = b'{"schema": "ocr.job.v1", "action": "create", "job_id": "j1", "at_ms": -5}'
    for raw, field in ((huge, "expected"), (early, "at_ms")):
        [rec] = _records([(JS.topics.jobs, raw)])
        assert rec.value is None and field in str(rec.error)
        [dlq] = asyncio.run(h.undecodable(rec, rec.error))
        assert dlq.topic == JS.topics.dlq and orjson.loads(dlq.value)["error_code"] == "invalid_request"


def _report_row(rid: str, name: str, fields: dict) -> dict:
    return {"request_id": rid, "filename": name, "status": "ok", "error_code": None, "pages": 1, "line_count": 1,
            "char_count": 3, "mean_confidence": None, "cache_hit": 0, "total_ms": 5.0, "inference_ms": None,
            "timings_json": None, "fields_json": orjson.dumps(fields).decode()}


def test_the_csv_report_is_rfc_4180_crlf_lines_and_quoted_fields_with_newlines():
    import csv

    rows = [_report_row("r1", "two\nlines.png", {"note": 'say "hi"\r\nbye'}), _report_row("r2", "b,c.png", {})]
    out = io.StringIO(newline="")
    assert write_rows(iter(rows), ["note"], {"csv": out}) == 2
    text = out.getvalue()
    blank = "," * 13  # the 13 stage times
    assert text == (",".join(report_columns(["note"])) + "\r\n"
                    + '"two\nlines.png",r1,ok,,1,1,3,,false,5.0' + blank + ',"say ""hi""\r\nbye"\r\n'
                    + '"b,c.png",r2,ok,,1,1,3,,false,5.0' + blank + ",\r\n")
    back = list(csv.reader(io.StringIO(text, newline="")))
    assert [(r[0], r[1], r[-1]) for r in back[1:]] == [("two\nlines.png", "r1", 'say "hi"\r\nbye'), ("b,c.png", "r2", "")]


def test_the_csv_report_neutralises_formulas_in_names_and_field_values():
    """OWASP's CSV injection: a cell starting with = + - @ TAB or CR is a formula to a spreadsheet;
    the CSV prefixes it with a single quote, a plain number stays as it is, the JSONL keeps the value."""
    import csv

    hostile = ['=HYPERLINK("http://evil.example","x")', "+cmd|' /C calc'!A0", "-1+1", "@SUM(A1:A9)", "\t=1+2",
               "\r=1+2"]
    rows = [_report_row(f"r{i}", name, {"total": name, "amount": "-12.50"}) for i, name in enumerate(hostile)]
    out, jsonl = io.StringIO(newline=""), io.StringIO()
    assert write_rows(iter(rows), ["total", "amount"], {"csv": out, "jsonl": jsonl}) == len(hostile)
    back = list(csv.DictReader(io.StringIO(out.getvalue(), newline="")))
    assert [r["name"] for r in back] == ["'" + h for h in hostile]
    assert [r["field:total"] for r in back] == ["'" + h for h in hostile]
    assert {r["field:amount"] for r in back} == {"-12.50"}
    assert [orjson.loads(ln)["name"] for ln in jsonl.getvalue().splitlines()] == hostile


def test_the_xlsx_report_writes_strings_as_text_and_replaces_characters_xml_cannot_hold(tmp_path):
    from openpyxl import load_workbook

    from services.cli.jobs import _write_xlsx

    rows = [_report_row("r1", "=HYPERLINK(\"http://x\")", {"total": "=1+2", "note": "bell\x07 and\x00nul\ttab"}),
            _report_row("r2", "+cmd|' /C calc'!A0", {"total": "-3", "note": None})]
    assert _write_xlsx(iter(rows), ["total", "note"], tmp_path / "r.xlsx") == 2
    ws = load_workbook(tmp_path / "r.xlsx")["report"]
    got = [[(c.value, c.data_type) for c in r] for r in ws.iter_rows(min_row=2)]
    assert got[0][0] == ('=HYPERLINK("http://x")', "s") and got[0][1] == ("r1", "s") and got[0][4] == (1, "n")
    assert got[0][-2:] == [("=1+2", "s"), ("bell\ufffd and\ufffdnul\ttab", "s")]
    assert got[1][0] == ("+cmd|' /C calc'!A0", "s") and got[1][-2] == ("-3", "s") and got[1][8] == (False, "b")
    assert [c.value for c in ws[1]][-2:] == ["field:total", "field:note"]
