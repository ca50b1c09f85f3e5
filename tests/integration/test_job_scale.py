"""A job of 1,000 images on the real stack: exact counts, one completion, the report, HTTP and SSE.

The module runs its own namespaced pipeline (the four stages, the jobs stage and the HTTP door)
with the CPU engine's detector limit at 96 px (``OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN``,
docs/engines.md): a one-line 400 x 90 px image is read in ~70 ms there instead of ~1.6 s at the
product's 736 px, so the job's 695 distinct images take a minute or two on 2 cores rather than
twenty. The text read is still checked exactly; the engine's accuracy on real documents is
tests/integration/test_accuracy.py's.
"""

from __future__ import annotations

import asyncio
import csv
import io
import signal
import time
import uuid

import httpx
import pytest

from schemas.events import CompletedEvent, ResultDocument
from schemas.jobs import JobCompletedEvent, JobEvent, JobProgress, job_completion_event_id
from services.cli.client import Submitter
from services.common.db import Database
from services.common.codec import completion_event_id, dumps, loads
from services.common.jobs.store import JobStore
from services.common.kafka import make_producer
from services.common.s3 import ObjectStore
from services.common.settings import CommonSettings
from tests.integration.conftest import API_ENV
from tests.integration.test_http_events import sse
from tests.jobs import BAD, BAD_CODES, job_completions, job_items, wait_final
from tests.stack import API, JOBS, db_rows, namespaced_pipeline

N = 1000  # 695 distinct images, 300 repeats (30%), 5 bad inputs
TAG = "SCALE"  # fixed text the engine reads (the namespace is new each run); the kill test reuses the images
FAST_ENGINE = {"OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN": "96"}


@pytest.fixture(scope="module")
def scale(pipeline, tmp_path_factory):
    """A namespaced pipeline with the jobs stage and the HTTP door (``.url``); the session's
    pipeline is started first (it takes the environment as it is when it starts)."""
    with namespaced_pipeline(tmp_path_factory.mktemp("job-scale-logs"), FAST_ENGINE, partitions=4) as p:
        p.start(JOBS)
        door = p.start(API, extra_env=API_ENV)
        p.url = f"http://127.0.0.1:{door.port}"
        yield p


async def test_a_job_of_1000_images_counts_each_once_completes_once_and_reads_the_same_everywhere(scale):
    """1,000 requests (300 repeats, 5 bad inputs) as one job, closed after they were all sent:
    the progress read while it runs only rises, to exactly 1,000 final (995 ok, 5 failed by their
    codes); a completion delivered twice counts once; one completion event, stored as produced;
    the CSV report's 1,000 rows match MariaDB's statuses; HTTP and the SSE stream answer the same."""
    s = CommonSettings()
    job_id = f"job-{uuid.uuid4().hex[:12]}"
    items = job_items(TAG, N)
    store = JobStore(Database(s.mysql, pool_size=1))
    sub = Submitter(s)
    await sub.start()
    try:
        await sub.job_event(JobEvent(action="create", job_id=job_id, name="one thousand"))
        started = time.monotonic()
        ids = await sub.submit_many(items, source="test", job_id=job_id)
        seen: list[JobProgress] = []
        await wait_final(store, job_id, N, seen, timeout=900)
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
    assert done == sorted(done) and done[-1] == N and len(set(done)) > 5  # read while it ran
    assert len(raws) == 1
    ev = loads(JobCompletedEvent, raws[0])
    prog = ev.progress
    assert ev.event_id == job_completion_event_id(job_id) and ev.name == "one thousand"
    assert (prog.state, prog.total, prog.done, prog.ok, prog.failed) == ("completed", N, N, N - 5, 5)
    assert prog.failed_by_code == BAD_CODES
    assert (prog.pages, prog.lines) == (N, N - 5)  # one page per request; one line per ok image
    assert prog.cache_hits == round(N * 0.3)
    assert ev.summary.by_status == {"error": 5, "ok": N - 5} and ev.summary.requests == N
    [row] = db_rows("SELECT completion_json, completion_sent FROM jobs WHERE job_id = %s", job_id)
    assert row == {"completion_json": raws[0].decode(), "completion_sent": 1}
    # the CSV report in S3: N rows whose statuses match MariaDB's requests
    body = (await ObjectStore(s.s3).get_uri(ev.report["csv"])).decode()
    rows = list(csv.DictReader(io.StringIO(body)))
    assert len(rows) == N and {r["request_id"] for r in rows} == set(ids)
    marks = ",".join(["%s"] * N)
    db = {r["request_id"]: (r["status"], r["error_code"] or "")
          for r in db_rows(f"SELECT request_id, status, error_code FROM requests WHERE request_id IN ({marks})", *ids)}
    assert {r["request_id"]: (r["status"], r["error_code"]) for r in rows} == db
    assert {r["name"]: r["error_code"] for r in rows if r["status"] == "error"} == {
        name: code.value for _, name, code in BAD}
    ok = {r["name"]: r for r in rows if r["status"] == "ok"}
    assert (ok["img007.png"]["lines"], ok["img694.png"]["characters"]) == ("1", str(len(f"JOB {TAG} 694")))
    # of an image and its repeat, exactly one was computed and the other answered from it: which one
    # depends on which reached dedup first (they were submitted on different ingest partitions)
    assert [sorted((ok[f"img{i:03d}.png"]["cache_hit"], ok[f"again{i:03d}.png"]["cache_hit"]))
            for i in (0, 299)] == [["false", "true"]] * 2
    # the same job over HTTP: its progress, its event stream (completed at once) and its report
    with httpx.Client(base_url=scale.url, timeout=60) as c:  # nothing else runs on this loop now
        over_http = c.get(f"/v1/jobs/{job_id}").json()
        with c.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
            events = [e for e in sse(resp) if "event" in e]
        report = c.get(f"/v1/jobs/{job_id}/report", params={"format": "csv"})
    assert over_http == prog.model_dump(mode="json")
    assert [e["event"] for e in events] == ["completed"] and events[0]["data"] == over_http
    assert report.text == body


async def test_sigkill_of_the_jobs_stage_mid_job_keeps_counts_exact(scale):
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
        scale.stop(scale.stages[JOBS][-1], sig=signal.SIGKILL)
        await sub.submit_many(items[n // 2:], source="test", job_id=job_id)
        scale.start(JOBS)
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
