"""Jobs on the real stack: a document in a job, a job over HTTP, the CLI, an extract job, the web page.

The 1,000-image job (exact counts under replay, one completion, the report against MariaDB) and
the SIGKILL of the jobs stage are tests/integration/test_job_scale.py's; a SIGKILL of every
stage, tests/fault/test_job_crashes.py's."""

from __future__ import annotations

import asyncio
import csv
import io
import os
import subprocess
import sys
import time
import uuid

import httpx
import orjson
import pytest

from schemas.events import ResultDocument
from schemas.jobs import JobCompletedEvent, JobEvent
from services.cli.client import Submitter
from services.common.db import Database
from services.common.codec import loads
from services.common.jobs.store import JobStore
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.integration.test_web_page import browser  # noqa: F401 - the headless Chromium fixture
from tests.jobs import job_completions, wait_final
from tests.stack import JOBS, REPO, db_rows


@pytest.fixture(scope="module")
def jobs_stage(pipeline):
    """The jobs stage (one process) beside the session's pipeline."""
    return pipeline.start(JOBS)


async def test_a_document_in_a_job_counts_once_with_its_pages(pipeline, jobs_stage):
    """A 3-page PDF and an image as one job of 2: the PDF is split into 3 page requests, but the
    job counts the document (its completion), never its pages; ``pages`` adds up to 3 + 1."""
    from tests.integration.test_documents import make_pdf, page_image

    s = CommonSettings()
    job_id = f"doc-{uuid.uuid4().hex[:12]}"
    pdf = make_pdf([page_image(f"CONTRACT PAGE {n}") for n in (1, 2, 3)])  # pages may be cache hits: same counts
    store = JobStore(Database(s.mysql, pool_size=1))
    sub = Submitter(s)
    await sub.start()
    try:
        await sub.job_event(JobEvent(action="create", job_id=job_id))
        ids = await sub.submit_many([(pdf, "contract.pdf"), (text_image(["CONTRACT PHOTO"]), "photo.png")],
                                    source="test", job_id=job_id)
        await sub.job_event(JobEvent(action="close", job_id=job_id, expected=2))
        await wait_final(store, job_id, 2, [])
    finally:
        await sub.stop()
    [raw] = await job_completions(job_id)
    prog = loads(JobCompletedEvent, raw).progress
    assert (prog.state, prog.done, prog.ok, prog.failed, prog.pages) == ("completed", 2, 2, 0, 4)
    rows = db_rows("SELECT request_id, pages FROM job_requests WHERE job_id = %s ORDER BY pages", job_id)
    assert rows == [{"request_id": ids[1], "pages": 1}, {"request_id": ids[0], "pages": 3}]
    [doc] = db_rows("SELECT document_json FROM requests WHERE request_id = %s", ids[0])
    assert ResultDocument.model_validate_json(doc["document_json"]).text == (
        "CONTRACT PAGE 1\n\nCONTRACT PAGE 2\n\nCONTRACT PAGE 3")


def test_a_job_over_http_from_create_to_report(api, jobs_stage):
    """Create, submit with job_id (one image the door answers from the cache, one new, one
    refused at the door and so not counted), close with the accepted count; then progress, the
    server-sent events and the report over HTTP."""
    from services.common.webhooks.signing import verify_signature
    from tests.integration.conftest import WEBHOOK_SECRET
    from tests.integration.test_http_events import sse
    from tests.integration.test_http_webhooks import Receiver

    with Receiver([200]) as rcv, httpx.Client(base_url=api.url, timeout=90) as c:
        made = c.post("/v1/jobs", json={"name": "over http", "webhook_url": f"{rcv.url}/hooks/job"})
        assert made.status_code == 201, made.text
        job_id = made.json()["job_id"]
        assert made.json()["links"]["self"] == f"/v1/jobs/{job_id}"
        new = text_image([f"HTTP JOB {uuid.uuid4().hex[:6]}"], size=28)
        hostile = '=HYPERLINK("http://evil.example/x","again")'  # a file name a spreadsheet would run
        answers = [c.post("/v1/ocr", params={"job_id": job_id, "filename": name}, content=data,
                          headers={"Content-Type": "image/png"})
                   for data, name in ((new, "new.png"), (new, hostile), (b"", "empty.png"))]
        assert [a.status_code for a in answers[:1]] == [202] and answers[2].status_code == 400
        accepted = [a.json()["request_id"] for a in answers if a.status_code in (200, 202)]
        assert len(accepted) == 2
        assert c.post(f"/v1/jobs/{job_id}/close", json={"expected": 2}).status_code == 202
        # a job never created: waited for up to 10 s, then the stream ends with not_found
        started = time.monotonic()
        with c.stream("GET", f"/v1/jobs/never-{uuid.uuid4().hex[:8]}/events", params={"timeout": 60}) as resp:
            unknown = [e for e in sse(resp) if "event" in e]
        assert [(e["event"], e["data"]["code"]) for e in unknown] == [("error", "not_found")]
        assert 9 < time.monotonic() - started < 30
        with c.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = [e for e in sse(resp) if "event" in e]
        assert events[-1]["event"] == "completed" and {e["event"] for e in events[:-1]} <= {"progress"}
        done = [e["data"]["done"] for e in events]
        assert done == sorted(done) and done[-1] == 2
        prog = c.get(f"/v1/jobs/{job_id}").json()
        assert prog == events[-1]["data"]
        assert (prog["state"], prog["total"], prog["ok"], prog["failed"]) == ("completed", 2, 2, 0)
        report = c.get(f"/v1/jobs/{job_id}/report", params={"format": "csv"})
        assert report.headers["content-type"].startswith("text/csv")
        rows = list(csv.DictReader(io.StringIO(report.text)))
        # the CSV neutralises the formula (a leading quote, OWASP's rule); the JSONL keeps the name as given
        assert sorted((r["request_id"], r["name"], r["status"]) for r in rows) == sorted(
            zip(accepted, ("new.png", "'" + hostile), ("ok", "ok")))
        lines = c.get(f"/v1/jobs/{job_id}/report", params={"format": "jsonl"}).text.splitlines()
        assert sorted(orjson.loads(ln)["name"] for ln in lines) == sorted(["new.png", hostile])
        assert c.get("/v1/jobs/no-such-job").status_code == 404
        # the job's webhook: its completion event, as published, signed like a request's
        deadline = time.monotonic() + 60
        while not rcv.hits and time.monotonic() < deadline:
            time.sleep(0.2)
        [hit] = rcv.hits
    [raw] = asyncio.run(job_completions(job_id, settle_s=0.5))
    h = hit["headers"]
    assert hit["path"] == "/hooks/job" and hit["body"] == raw
    assert verify_signature(WEBHOOK_SECRET, h["X-Ocrstream-Delivery"], h["X-Ocrstream-Timestamp"], hit["body"],
                            h["X-Ocrstream-Signature"])


def test_ocrstream_submit_is_a_job_and_job_status_and_report_read_it(jobs_stage, tmp_path):
    """`ocrstream submit FOLDER` creates, fills and closes a job and prints its id; `job status`
    waits for it; `job report` writes its rows as CSV and xlsx."""
    from openpyxl import load_workbook

    folder = tmp_path / "batch"
    folder.mkdir()
    image = text_image([f"CLI JOB {uuid.uuid4().hex[:6]}"], size=28)
    (folder / "a.png").write_bytes(image)
    (folder / "b.png").write_bytes(b"")
    (folder / "c.png").write_bytes(image)  # a copy: answered from the cache

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "COLUMNS": "200"})

    sub = cli("submit", str(folder), "--no-wait", "--name", "cli batch")
    assert sub.returncode == 0, sub.stdout + sub.stderr
    head = sub.stdout.splitlines()[0]
    assert head.startswith("job ") and head.endswith(": 3 requests (ocrstream job status " + head.split()[1][:-1] + ")")
    job_id = head.split()[1][:-1]
    status = cli("job", "status", job_id, "--timeout", "240")
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.startswith("completed: 3/3 done, 2 ok, 1 failed (empty_input 1), 1 cache hit, 3 pages")
    rep = cli("job", "report", job_id, "--format", "csv")
    assert rep.returncode == 0, rep.stderr
    rows = sorted((r["name"], r["status"], r["error_code"]) for r in csv.DictReader(io.StringIO(rep.stdout)))
    assert rows == [("a.png", "ok", ""), ("b.png", "error", "empty_input"), ("c.png", "ok", "")]
    out = tmp_path / "r.xlsx"
    assert cli("job", "report", job_id, "--format", "xlsx", "--out", str(out)).returncode == 0
    sheet = list(load_workbook(out).active.iter_rows(values_only=True))
    assert sheet[0][:4] == ("name", "request_id", "status", "error_code") and len(sheet) == 4
    assert sorted((r[0], r[2]) for r in sheet[1:]) == [("a.png", "ok"), ("b.png", "error"), ("c.png", "ok")]
    db = db_rows("SELECT name, expected FROM jobs WHERE job_id = %s", job_id)
    assert db == [{"name": "cli batch", "expected": 3}]


async def test_an_extract_job_reports_one_column_per_field(tmp_path_factory, stack_env):
    """An `extract` job on the loopback OpenAI-compatible model server (tests/integration/test_tasks.py's
    recorded answer): the report has a `field:<name>` column per field asked, with the values."""
    from schemas.tasks import TaskParams
    from services.common.s3 import ObjectStore
    from tests.integration.test_tasks import EXTRACT, FIELDS
    from tests.stack import LoopbackOcrServer, namespaced_pipeline

    srv = LoopbackOcrServer("WARM UP")
    srv.replies = {EXTRACT.prompt: ('```json\n{"invoice number": "=cmd|\' /C calc\'!A0", "date": "2026-12-03", '
                                    '"total": "-12.50"}\n```', "stop")}
    srv.start()
    extra = {"OCRSTREAM_ENGINE_KIND": "openai", "OCRSTREAM_OPENAI_BASE_URL": srv.url,
             "OCRSTREAM_OPENAI_READY_TIMEOUT_S": "60"}
    try:
        with namespaced_pipeline(tmp_path_factory.mktemp("extract-job-logs"), extra, partitions=2) as p:
            p.start(JOBS)
            s = CommonSettings()
            job_id, params = f"extract-{uuid.uuid4().hex[:12]}", TaskParams(fields=FIELDS)
            sub = Submitter(s)
            await sub.start()
            try:
                await sub.job_event(JobEvent(action="create", job_id=job_id, task="extract", task_params=params))
                await sub.job_event(JobEvent(action="close", job_id=job_id, expected=2))
            finally:
                await sub.stop()
            items = [(text_image([f"INVOICE {uuid.uuid4().hex[:6]}"]), name) for name in ("inv0.png", "@SUM(A1:A9)")]
            docs = await p.run(items, task="extract", task_params=params, job_id=job_id)
            assert [d.status for d in docs] == ["ok", "ok"]
            [raw] = await job_completions(job_id, settle_s=0.5)
            ev = loads(JobCompletedEvent, raw)
            body = await ObjectStore(s.s3).get_uri(ev.report["csv"])
    finally:
        srv.stop()
    rows = list(csv.DictReader(io.StringIO(body.decode())))
    assert list(rows[0])[-3:] == ["field:invoice number", "field:date", "field:total"]
    # the S3 copy of the CSV neutralises a formula in a file name and in a model's field value
    # (a leading quote); a plain negative number stays a number
    assert sorted((r["name"], r["field:invoice number"], r["field:date"], r["field:total"]) for r in rows) == [
        ("'@SUM(A1:A9)", "'=cmd|' /C calc'!A0", "2026-12-03", "-12.50"),
        ("inv0.png", "'=cmd|' /C calc'!A0", "2026-12-03", "-12.50")]


def test_the_web_page_follows_a_job_to_its_failures(api, jobs_stage, browser, tmp_path):
    """(Last in the module: Playwright's sync API holds an event loop open in this thread until
    the module's browser closes, and the async tests need theirs.) `/?job=ID` shows the job's progress bar and counts until it completes, then lists its
    failed requests with their codes and links the CSV report."""
    from playwright.sync_api import expect

    folder = tmp_path / "web"
    folder.mkdir()
    (folder / "good.png").write_bytes(text_image([f"WEB JOB {uuid.uuid4().hex[:6]}"], size=28))
    (folder / "empty.png").write_bytes(b"")
    sub = subprocess.run([sys.executable, "-m", "services.cli", "submit", str(folder), "--no-wait"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id = sub.stdout.split()[1].rstrip(":")
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{api.url}/?job={job_id}")
        expect(page.locator("#job-id")).to_have_value(job_id)
        expect(page.locator("#job-state")).to_contain_text(
            "completed: 2/2 done, 1 ok, 1 failed (empty_input 1), 0 cache hits, 2 pages", timeout=120_000)
        expect(page.locator("#job-failures li")).to_have_text(["empty.png: empty_input"])
        expect(page.locator("#job-report")).to_have_attribute("href", f"v1/jobs/{job_id}/report?format=csv")
        assert page.locator("#job-progress").evaluate("p => [p.value, p.max]") == [2, 2]
        assert errors == []
    finally:
        ctx.close()
