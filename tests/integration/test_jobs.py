"""Jobs on the real stack: exact counts under replay, one completion event, the report in S3."""

from __future__ import annotations

import asyncio
import csv
import io
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from schemas.events import CompletedEvent, ResultDocument
from schemas.jobs import JobCompletedEvent, JobEvent, JobProgress, job_completion_event_id
from services.cli.client import Submitter
from services.common.db import Database
from services.common.events import completion_event_id, dumps, loads
from services.common.jobs import JobStore
from services.common.kafka import make_producer
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.integration.test_web_page import browser  # noqa: F401 - the headless Chromium fixture
from tests.jobs import BAD, BAD_CODES, job_completions, job_items, wait_final
from tests.stack import JOBS, REPO, db_rows

N = 100  # images per job: 65 unique, 30 repeats (30%), 5 bad inputs (200 took 6 min on a loaded 2-core VM)
TAG = uuid.uuid4().hex[:6]  # this session's images: the kill test's are the first test's (cache hits)


@pytest.fixture(scope="module")
def jobs_stage(pipeline):
    """The jobs stage (one process) beside the session's pipeline."""
    return pipeline.start(JOBS)


async def test_a_job_counts_each_request_once_and_completes_once(pipeline, jobs_stage, s3):
    s = CommonSettings()
    job_id, tag = f"job-{uuid.uuid4().hex[:12]}", TAG
    items = job_items(tag, N)
    store = JobStore(Database(s.mysql, pool_size=1))
    sub = Submitter(s)
    await sub.start()
    try:
        await sub.job_event(JobEvent(action="create", job_id=job_id, name="two hundred"))
        started = time.monotonic()
        ids = await sub.submit_many(items, source="test", job_id=job_id)
        seen: list[JobProgress] = []
        await wait_final(store, job_id, N, seen)
        elapsed = time.monotonic() - started
        # a request completed twice (at-least-once delivery) counts once
        doc = ResultDocument.model_validate_json(db_rows(
            "SELECT document_json FROM requests WHERE request_id = %s", ids[0])[0]["document_json"])
        producer = make_producer(s.kafka, client_id="test-jobs")
        await producer.start()
        try:
            dup = CompletedEvent(event_id=completion_event_id(ids[0]), request_id=ids[0], result=doc)
            await producer.send_and_wait(s.topics.completed, dumps(dup), key=ids[0].encode())
        finally:
            await producer.stop()
        assert (await store.progress(job_id)).state == "open"
        await sub.job_event(JobEvent(action="close", job_id=job_id, expected=N))
        await sub.job_event(JobEvent(action="close", job_id=job_id, expected=N))  # a replayed close
    finally:
        await sub.stop()
    raws = await job_completions(job_id)
    print(f"job of {N}: all final in {elapsed:.1f}s ({N / elapsed:.1f} images/s)")
    done = [p.done for p in seen]
    assert done == sorted(done) and done[-1] == N
    assert len(raws) == 1
    ev = loads(JobCompletedEvent, raws[0])
    prog = ev.progress
    assert ev.event_id == job_completion_event_id(job_id) and ev.name == "two hundred"
    assert (prog.state, prog.total, prog.done, prog.ok, prog.failed) == ("completed", N, N, N - 5, 5)
    assert prog.failed_by_code == BAD_CODES
    assert (prog.pages, prog.lines) == (N - 5 + 5, N - 5)  # one page per request; one line per ok image
    assert prog.cache_hits == round(N * 0.3)
    assert ev.summary.by_status == {"error": 5, "ok": N - 5} and ev.summary.requests == N
    assert ev.completed_at_ms == prog.last_completed_at_ms
    # the stored event is the bytes produced
    [row] = db_rows("SELECT completion_json, completion_sent FROM jobs WHERE job_id = %s", job_id)
    assert row == {"completion_json": raws[0].decode(), "completion_sent": 1}
    # the CSV report: N rows whose statuses match MariaDB's requests
    body = s3.get_object(Bucket=s3.bucket, Key=f"reports/{job_id}/report.csv")["Body"].read().decode()
    rows = list(csv.DictReader(io.StringIO(body)))
    assert len(rows) == N and {r["request_id"] for r in rows} == set(ids)
    marks = ",".join(["%s"] * N)
    db = {r["request_id"]: (r["status"], r["error_code"] or "")
          for r in db_rows(f"SELECT request_id, status, error_code FROM requests WHERE request_id IN ({marks})", *ids)}
    assert {r["request_id"]: (r["status"], r["error_code"]) for r in rows} == db
    bad = {r["name"]: r["error_code"] for r in rows if r["status"] == "error"}
    assert bad == {name: code.value for _, name, code in BAD}
    ok = {r["name"]: r for r in rows if r["status"] == "ok"}
    assert ok["img007.png"]["lines"] == "1" and ok["img007.png"]["characters"] == str(len(f"JOB {tag} 007"))
    for part in ("report.jsonl", "summary.json", "chart.png"):
        assert s3.head_object(Bucket=s3.bucket, Key=f"reports/{job_id}/{part}")["ContentLength"] > 0


async def test_sigkill_of_the_jobs_stage_mid_job_keeps_counts_exact(pipeline, jobs_stage):
    """The jobs stage SIGKILLed while the job's completions stream in (the first half counted in
    part), the second half completing while it is down: the replacement replays what was not
    committed; the counts stay exact and the job completes once."""
    s = CommonSettings()
    n, job_id = 40, f"kill-{uuid.uuid4().hex[:12]}"
    items = job_items(TAG, n)  # the first test's images where it ran: mostly cache hits, fast
    store = JobStore(Database(s.mysql, pool_size=1))
    sub = Submitter(s)
    await sub.start()
    try:
        await sub.job_event(JobEvent(action="create", job_id=job_id))
        await sub.job_event(JobEvent(action="close", job_id=job_id, expected=n))  # closed before any completion
        await sub.submit_many(items[: n // 2], source="test", job_id=job_id)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            prog = await store.progress(job_id)
            if prog is not None and prog.done >= 5:
                break
            await asyncio.sleep(0.05)
        pipeline.stop(pipeline.stages[JOBS][-1], sig=signal.SIGKILL)
        await sub.submit_many(items[n // 2:], source="test", job_id=job_id)
        pipeline.start(JOBS)
        seen: list[JobProgress] = []
        await wait_final(store, job_id, n, seen)
    finally:
        await sub.stop()
    done = [p.done for p in seen]
    assert done == sorted(done) and done[-1] == n
    raws = await job_completions(job_id)
    assert len(raws) == 1
    ev = loads(JobCompletedEvent, raws[0])
    assert (ev.progress.done, ev.progress.ok, ev.progress.failed) == (n, n - 5, 5)
    assert db_rows("SELECT COUNT(*) AS n FROM job_requests WHERE job_id = %s", job_id) == [{"n": n}]


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
    from services.api.signing import verify_signature
    from tests.integration.conftest import WEBHOOK_SECRET
    from tests.integration.test_http_events import sse
    from tests.integration.test_http_webhooks import Receiver

    with Receiver([200]) as rcv, httpx.Client(base_url=api.url, timeout=90) as c:
        made = c.post("/v1/jobs", json={"name": "over http", "webhook_url": f"{rcv.url}/hooks/job"})
        assert made.status_code == 201, made.text
        job_id = made.json()["job_id"]
        assert made.json()["links"]["self"] == f"/v1/jobs/{job_id}"
        new = text_image([f"HTTP JOB {uuid.uuid4().hex[:6]}"], size=28)
        answers = [c.post(f"/v1/ocr?job_id={job_id}&filename={name}", content=data,
                          headers={"Content-Type": "image/png"})
                   for data, name in ((new, "new.png"), (new, "again.png"), (b"", "empty.png"))]
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
        assert sorted((r["request_id"], r["name"], r["status"]) for r in rows) == sorted(
            zip(accepted, ("new.png", "again.png"), ("ok", "ok")))
        lines = c.get(f"/v1/jobs/{job_id}/report", params={"format": "jsonl"}).text.splitlines()
        assert len(lines) == 2
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
    assert status.stdout.startswith("completed: 3/3 done, 2 ok, 1 failed (empty_input 1), 1 cache hits, 3 pages")
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
    srv.replies = {EXTRACT.prompt: ('```json\n{"invoice number": "INV-9", "date": "2026-12-03"}\n```', "stop")}
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
            items = [(text_image([f"INVOICE {uuid.uuid4().hex[:6]}"]), f"inv{i}.png") for i in range(2)]
            docs = await p.run(items, task="extract", task_params=params, job_id=job_id)
            assert [d.status for d in docs] == ["ok", "ok"]
            [raw] = await job_completions(job_id, settle_s=0.5)
            ev = loads(JobCompletedEvent, raw)
            body = await ObjectStore(s.s3).get_uri(ev.report["csv"])
    finally:
        srv.stop()
    rows = list(csv.DictReader(io.StringIO(body.decode())))
    assert list(rows[0])[-3:] == ["field:invoice number", "field:date", "field:total"]
    assert sorted((r["name"], r["field:invoice number"], r["field:date"], r["field:total"]) for r in rows) == [
        ("inv0.png", "INV-9", "2026-12-03", ""), ("inv1.png", "INV-9", "2026-12-03", "")]


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
