"""Jobs' inputs on the real stack: with API keys on, a job is its creating key's alone (others may not
add to it, close it or read it, and cannot tell it exists); a close naming fewer requests than are
final already is refused. A keyed HTTP door and the jobs stage only (no pipeline: the completions
a job counts are published on ``ocr.completed`` as the sink publishes them)."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from schemas.events import CompletedEvent, ResultDocument
from schemas.jobs import JobEvent
from services.cli.client import Submitter
from services.common.db import Database
from services.common.codec import dumps
from services.common.jobs.store import JobStore
from services.common.kafka import make_producer
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.integration.test_http_auth import make_key  # noqa: F401 - keys made by the real CLI
from tests.integration.test_http_events import sse
from tests.stack import API, JOBS, Pipeline

pytestmark = pytest.mark.stack

# the owner's first submission waits this long for the jobs stage to record its create: room for a
# loaded 2-core CI machine (4 s was once too little there); every refusal below waits it too
JOB_WAIT_S = 8.0
KEYED_ENV = {
    "OCRSTREAM_AUTH_REQUIRED": "true",
    "OCRSTREAM_AUTH_CACHE_S": "0.5",
    "OCRSTREAM_WEBHOOK_ENABLED": "false",
    "OCRSTREAM_HTTP_JOB_WAIT_S": str(JOB_WAIT_S),
}


@pytest.fixture(scope="module")
def door(stack_env, tmp_path_factory):
    """A keyed HTTP door (base URL in ``.url``) and the jobs stage, on the session's namespace."""
    p = Pipeline(env=stack_env, logdir=tmp_path_factory.mktemp("job-inputs-logs"))
    try:
        api = p.start(API, extra_env=KEYED_ENV, wait_ready=False)
        p.start(JOBS, wait_ready=False)
        for st in (api, p.stages[JOBS][0]):
            p.wait_ready(st)
        api.url = f"http://127.0.0.1:{api.port}"
        # the stage has read and recorded a job once (its consumer fetching, its MariaDB pool open)
        # before a test times the wait of a job just created
        warm = f"warm-{uuid.uuid4().hex[:8]}"
        asyncio.run(_publish_jobs([JobEvent(action="create", job_id=warm, name="warm-up")]))
        _recorded(warm, timeout=60)
        yield api
    finally:
        p.stop_all()


def _recorded(job_id: str, timeout: float = 30) -> None:
    """Wait until the jobs stage has the job's create event."""
    store = JobStore(Database(CommonSettings().mysql, pool_size=1))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = asyncio.run(store.job(job_id))
        if job is not None and job.created_at_ms is not None:
            return
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} not recorded")


def _timed(call) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = call()
    return r, time.monotonic() - started


def test_with_keys_a_job_is_its_creators_alone_and_another_key_cannot_tell_it_exists(door, make_key):  # noqa: F811
    k, other = make_key("owner"), make_key("other")
    png = text_image([f"OWNED {uuid.uuid4().hex[:6]}"], size=28)
    with httpx.Client(base_url=door.url, timeout=60, headers={"X-API-Key": k.token}) as mine, \
            httpx.Client(base_url=door.url, timeout=60, headers={"X-API-Key": other.token}) as theirs:
        made = mine.post("/v1/jobs", json={"name": "k's job"})
        assert made.status_code == 201, made.text
        job_id = made.json()["job_id"]
        # the owner's submission waits for the stage to record the job, then is accepted
        first = mine.post(f"/v1/ocr?job_id={job_id}", content=png, headers={"Content-Type": "image/png"})
        assert first.status_code == 202, first.text
        _recorded(job_id)
        unknown = f"never-{uuid.uuid4().hex[:8]}"
        nobody = {"error": {"code": "not_found", "message": f"no job {unknown!r} of this API key (POST /v1/jobs "
                                                            f"creates one)"}}
        refused = {"error": {"code": "not_found", "message": f"no job {job_id!r} of this API key (POST /v1/jobs "
                                                             f"creates one)"}}
        # another key: its job and a job nobody created are answered alike, after the same wait
        for jid, body in ((job_id, refused), (unknown, nobody)):
            one, took = _timed(lambda: theirs.post(f"/v1/ocr?job_id={jid}", content=png,
                                                   headers={"Content-Type": "image/png"}))
            assert (one.status_code, one.json()) == (404, body)
            assert JOB_WAIT_S <= took < JOB_WAIT_S + 30
            batch = theirs.post(f"/v1/ocr/batch?job_id={jid}", files=[("file", ("a.png", png, "image/png"))])
            assert (batch.status_code, batch.json()) == (404, body)
            close, took = _timed(lambda: theirs.post(f"/v1/jobs/{jid}/close", json={"expected": 0}))
            assert (close.status_code, close.json()) == (404, body)
            assert JOB_WAIT_S <= took < JOB_WAIT_S + 30
            for path in (f"/v1/jobs/{jid}", f"/v1/jobs/{jid}/report?format=csv"):
                r = theirs.get(path)
                assert (r.status_code, r.json()) == (404, {"error": {"code": "not_found", "message": f"no job {jid!r}"}})
            started = time.monotonic()
            with theirs.stream("GET", f"/v1/jobs/{jid}/events", params={"timeout": 30}) as resp:
                assert resp.status_code == 200
                events = [e for e in sse(resp) if "event" in e]
            assert events == [{"event": "error", "data": {"code": "not_found", "message": f"no job {jid}"}}]
            assert JOB_WAIT_S <= time.monotonic() - started < JOB_WAIT_S + 30
        # nothing of theirs reached the job; the owner reads it, its close counts
        assert mine.post(f"/v1/jobs/{job_id}/close", json={"expected": 1}).status_code == 202
        deadline = time.monotonic() + 30
        while (prog := mine.get(f"/v1/jobs/{job_id}").json())["state"] == "open" and time.monotonic() < deadline:
            time.sleep(0.1)
        # total 1: only the owner's request is the job's; it is final (and the job completed) when the
        # session's pipeline runs on this namespace (an earlier test started it), pending otherwise
        assert (prog["name"], prog["total"]) == ("k's job", 1), prog
        assert (prog["state"], prog["done"]) in (("closed", 0), ("closed", 1), ("completed", 1)), prog
        # a job without an owner (created on Kafka, as an upstream producer does) stays open to every key
        kafka_job = f"kafka-{uuid.uuid4().hex[:8]}"
        asyncio.run(_publish_jobs([JobEvent(action="create", job_id=kafka_job, name="upstream")]))
        _recorded(kafka_job)
        for c in (mine, theirs):
            r = c.post(f"/v1/ocr?job_id={kafka_job}", content=png, headers={"Content-Type": "image/png"})
            assert r.status_code in (200, 202), r.text
            assert c.get(f"/v1/jobs/{kafka_job}").json()["name"] == "upstream"


async def _publish_jobs(events: list[JobEvent]) -> None:
    sub = Submitter(CommonSettings())
    await sub.start()
    try:
        for ev in events:
            await sub.job_event(ev)
    finally:
        await sub.stop()


async def _publish_final(job_id: str, n: int) -> list[str]:
    """``n`` final requests of the job on ``ocr.completed``, as the sink publishes them."""
    s = CommonSettings()
    producer = make_producer(s.kafka, client_id="test-job-inputs")
    await producer.start()
    rids = [f"{job_id}-r{i}" for i in range(n)]
    try:
        for i, rid in enumerate(rids):
            doc = ResultDocument(request_id=rid, status="ok", job_id=job_id, completed_at_ms=1_000 + i,
                                 submitted_at_ms=900)
            await producer.send_and_wait(s.topics.completed, dumps(CompletedEvent(event_id=rid, request_id=rid,
                                                                                  result=doc)), key=rid.encode())
    finally:
        await producer.stop()
    return rids


def test_a_close_below_the_requests_already_final_is_409_and_an_honest_one_completes(door, make_key):  # noqa: F811
    k = make_key("closer")
    with httpx.Client(base_url=door.url, timeout=60, headers={"X-API-Key": k.token}) as c:
        job_id = c.post("/v1/jobs", json={"name": "three"}).json()["job_id"]
        _recorded(job_id)
        asyncio.run(_publish_final(job_id, 3))
        deadline = time.monotonic() + 30
        while c.get(f"/v1/jobs/{job_id}").json()["done"] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        low = c.post(f"/v1/jobs/{job_id}/close", json={"expected": 2})
        assert (low.status_code, low.json()) == (409, {"error": {
            "code": "job_expected_too_small",
            "message": f"job {job_id!r} already has 3 final requests, more than expected 2: close it with at least 3"}})
        assert c.get(f"/v1/jobs/{job_id}").json()["state"] == "open"  # nothing was sent
        assert c.post(f"/v1/jobs/{job_id}/close", json={"expected": 3}).status_code == 202
        deadline = time.monotonic() + 60
        while (prog := c.get(f"/v1/jobs/{job_id}").json())["state"] != "completed" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (prog["state"], prog["total"], prog["done"], prog["ok"]) == ("completed", 3, 3, 3)
        # closed: a later close changes nothing and is answered as the first was (a retry is safe)
        assert c.post(f"/v1/jobs/{job_id}/close", json={"expected": 2}).status_code == 202


async def _dlq_of(key: str, timeout: float = 30) -> list:
    """The ``ocr.dlq`` events (every partition, from the start) whose original key is ``key``."""
    import base64

    from aiokafka import TopicPartition

    from schemas.events import DlqEvent
    from services.common.kafka import make_consumer

    s = CommonSettings()
    consumer = make_consumer(s.kafka, [], None, client_id="test-job-inputs-dlq", auto_offset_reset="earliest")
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()
        tps = [TopicPartition(s.topics.dlq, p) for p in sorted(consumer.partitions_for_topic(s.topics.dlq) or ())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        found: list[DlqEvent] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(found) < 2:
            for recs in (await consumer.getmany(timeout_ms=300)).values():
                evs = [DlqEvent.model_validate_json(r.value) for r in recs]
                found += [e for e in evs if e.key_b64 and base64.b64decode(e.key_b64).decode() == key]
        return found
    finally:
        await consumer.stop()


async def _publish_raw(values: list[tuple[str, bytes]]) -> None:
    """Job events as an upstream producer's bytes, all on partition 0 of ``ocr.jobs`` (in this order)."""
    s = CommonSettings()
    producer = make_producer(s.kafka, client_id="test-job-inputs")
    await producer.start()
    try:
        for key, raw in values:
            await producer.send_and_wait(s.topics.jobs, raw, key=key.encode(), partition=0)
    finally:
        await producer.stop()


def test_a_kafka_close_over_the_int_column_goes_to_the_dlq_and_the_stage_reads_on(door):
    bad, good = f"huge-{uuid.uuid4().hex[:8]}", f"after-{uuid.uuid4().hex[:8]}"
    asyncio.run(_publish_raw([
        (bad, b'{"schema": "ocr.job.v1", "action": "close", "job_id": "%s", "expected": 2147483648}'
         % bad.encode()),
        (bad, b'{"schema": "ocr.job.v1", "action": "create", "job_id": "%s", "at_ms": -1}' % bad.encode()),
        (good, dumps(JobEvent(action="create", job_id=good, name="after"))),
        (good, dumps(JobEvent(action="close", job_id=good, expected=0))),
    ]))
    store = JobStore(Database(CommonSettings().mysql, pool_size=1))
    deadline = time.monotonic() + 30
    while ((prog := asyncio.run(store.progress(good))) is None or prog.state != "completed") \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (prog.state, prog.total, prog.done) == ("completed", 0, 0)  # the stage read on past them
    assert asyncio.run(store.job(bad)) is None  # nothing of the bad events was written
    dlq = asyncio.run(_dlq_of(bad))
    assert [(e.stage, e.error_code.value, e.attempts) for e in dlq] == [("jobs", "invalid_request", 1)] * 2
    # one DLQ event each, in whichever order the DLQ's partitions are read (no order is promised)
    close, create = sorted(dlq, key=lambda e: "at_ms" in e.reason)
    assert "expected" in close.reason and "less than or equal to 2147483647" in close.reason
    assert "at_ms" in create.reason and "greater than or equal to 0" in create.reason
