"""Single flight when the lease holder fails: waiters are never left hanging (issue #3).

The policy (``services/sink/handler.py``, ``schemas/errors.py`` ``RETRYABLE_CODES``, README
"Single flight and the cache"):

* holder ends with ``engine_error`` (retryable): one waiter is promoted and re-sent to inference;
* holder ends with an input error or ``timeout`` (same bytes, same outcome): every waiter shares it;
* holder goes silent (lease expired): dedup's reaper promotes one waiter.

The engine that fails on demand is real HTTP: infer runs its ``openai`` engine against a small
OpenAI-compatible OCR server on loopback (stdlib, a thread of this process) that answers as
each test scripts it: a 500 (``engine_error``), a stall past ``infer_timeout_s`` (``timeout``),
or a HunyuanOCR text-spotting answer. RapidOCR has no input that makes it raise. Everything else
(Kafka, Redis, MariaDB, S3, the four stage processes) is the real stack.

To make the order deterministic without timing, the tests stop the stage that would settle
the holder (the sink, or infer) until the copies have joined the holder's lease, as dedup's
metrics show.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis

from schemas.errors import ErrorCode
from tests.conftest import CASES, text_image
from tests.stack import Pipeline, Stage, free_port, metric_value, namespaced_pipeline

COPIES = 4
INFER_TIMEOUT_S = 8  # the stub stalls longer than this to make a ``timeout``


class OcrServer:
    """An OpenAI-compatible OCR server on 127.0.0.1 whose answers the test scripts.

    ``fail_next`` / ``stall_next`` / ``hold_next`` count the next chat-completion requests
    answered with HTTP 500 / after ``INFER_TIMEOUT_S + 5`` s / once ``gate`` is set (at most 30 s);
    the others get ``answer`` as a text-spotting line. ``posts`` counts chat-completion requests
    (the engine's warm-up included), on arrival.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.posts = 0
        self.fail_next = 0
        self.stall_next = 0
        self.hold_next = 0
        self.gate = threading.Event()
        self.answer = "NOTHING SCRIPTED"
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, {})
                else:
                    self._send(200, {"data": [{"id": "tencent/HunyuanOCR"}]})

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with srv.lock:
                    srv.posts += 1
                    fail, stall, hold = srv.fail_next > 0, srv.stall_next > 0, srv.hold_next > 0
                    if fail:
                        srv.fail_next -= 1
                    elif stall:
                        srv.stall_next -= 1
                    elif hold:
                        srv.hold_next -= 1
                    answer = srv.answer
                if fail:
                    return self._send(500, {"error": "scripted engine failure"})
                if stall:
                    time.sleep(INFER_TIMEOUT_S + 5)
                elif hold:
                    srv.gate.wait(30)
                content = f"{answer}(100,100),(900,400)"
                self._send(200, {"choices": [{"message": {"content": content}, "finish_reason": "stop"}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def script(self, answer: str, fail_next: int = 0, stall_next: int = 0, hold_next: int = 0) -> int:
        """Set what the next requests get (a failure first, then a stall, then a hold); returns
        ``posts`` so far."""
        with self.lock:
            self.answer, self.fail_next, self.stall_next, self.hold_next = answer, fail_next, stall_next, hold_next
            self.gate.clear()
            return self.posts


@pytest.fixture(scope="module")
def ocr_server():
    srv = OcrServer()
    yield srv
    srv.httpd.shutdown()


@pytest.fixture(scope="module")
def sfp(stack_env, ocr_server, tmp_path_factory):
    """A pipeline of its own whose infer uses the scripted OCR server (one attempt per image)."""
    extra = {
        "OCRSTREAM_ENGINE_KIND": "openai",
        "OCRSTREAM_OPENAI_BASE_URL": ocr_server.url,
        "OCRSTREAM_OPENAI_RETRIES": "1",
        "OCRSTREAM_OPENAI_READY_TIMEOUT_S": "60",
        "OCRSTREAM_LIMITS__INFER_TIMEOUT_S": str(INFER_TIMEOUT_S),
    }
    with namespaced_pipeline(tmp_path_factory.mktemp("sf-fail-logs"), extra) as p:
        yield p


def live(p: Pipeline, name: str) -> Stage:
    """The one live process of stage ``name``."""
    [st] = [s for s in p.stages[name] if s.proc.poll() is None]
    return st


def dedup_count(p: Pipeline, outcome: str, tier: str = "redis") -> float:
    return metric_value(p.metrics("dedup"), "ocrstream_cache_total", outcome=outcome, tier=tier)


def infer_events(p: Pipeline) -> float:
    """``ocr.infer`` events the live infer processes consumed (holders' and promoted waiters')."""
    return metric_value(p.metrics("infer"), "ocrstream_messages_in_total")


async def until(cond, what: str, timeout: float = 120) -> None:
    """Poll ``cond()`` until true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def redis_client() -> tuple[redis.Redis, str]:
    return redis.Redis.from_url(os.environ.get("OCRSTREAM_REDIS__URL", "redis://127.0.0.1:6379/0")), \
        os.environ["OCRSTREAM_REDIS__KEY_PREFIX"]


async def assert_no_flight_left(cache_key: str) -> None:
    """The lease, the waiter list and the in-flight mark of ``cache_key`` are all gone
    (released by the sink after the completions were acknowledged)."""
    r, prefix = redis_client()
    try:
        await until(lambda: not r.exists(f"{prefix}:lease:{cache_key}", f"{prefix}:wait:{cache_key}")
                    and r.zscore(f"{prefix}:inflight", cache_key) is None, f"lease on {cache_key} released")
    finally:
        r.close()


async def holder_then_copies(p: Pipeline, data: bytes) -> tuple[asyncio.Task, asyncio.Task]:
    """Submit one request, wait until it holds the lease, then ``COPIES`` copies and wait until
    every copy joined it. Returns the two runs (holder's, copies')."""
    misses, joined = dedup_count(p, "miss"), dedup_count(p, "joined")
    holder = asyncio.create_task(p.run([(data, "holder.png")], timeout=300))
    await until(lambda: dedup_count(p, "miss") == misses + 1, "the holder to take the lease")
    copies = asyncio.create_task(p.run([(data, f"copy-{i}.png") for i in range(COPIES)], timeout=300))
    await until(lambda: dedup_count(p, "joined") == joined + COPIES, "the copies to join the lease")
    return holder, copies


async def test_engine_error_of_the_holder_promotes_one_waiter(sfp, ocr_server):
    p = sfp
    data = text_image(["PROMOTE ME 7101"])
    p.stop(live(p, "sink"))  # nothing settles the holder until the copies have joined
    # the holder's inference gets an HTTP 500; the promoted copy's is held until we have looked
    posts = ocr_server.script("PROMOTED 7101", fail_next=1, hold_next=1)
    calls, events = p.engine_calls(), infer_events(p)
    holder_run, copies_run = await holder_then_copies(p, data)
    p.start("sink", {"OCRSTREAM_LEASE_MS": "120000"})
    await until(lambda: ocr_server.posts == posts + 2, "the promoted copy's inference")
    r, prefix = redis_client()
    try:  # the sink gave the promoted copy the configured lease (dedup's claim had 600,000 ms)
        [key] = r.zrange(f"{prefix}:inflight", 0, -1)
        lease_left = r.pttl(f"{prefix}:lease:{key.decode()}")
        waiting = r.llen(f"{prefix}:wait:{key.decode()}")
    finally:
        r.close()
        ocr_server.gate.set()
    assert 0 < lease_left <= 120_000 and waiting == COPIES - 1, (lease_left, waiting)
    [holder] = await holder_run
    copies = await copies_run
    assert holder.status == "error" and holder.error.code is ErrorCode.ENGINE_ERROR, holder.error
    for c in copies:
        assert c.status == "ok" and c.text == "PROMOTED 7101", (c.status, c.error, c.text)
    # exactly one copy was promoted and computed; the other three were completed with its result
    assert sorted(c.cache_hit for c in copies) == [False, True, True, True]
    assert p.engine_calls() - calls == 2 and ocr_server.posts - posts == 2 and infer_events(p) - events == 2
    await assert_no_flight_left(holder.cache_key)


@pytest.mark.parametrize("case", ["corrupt_image", "timeout"])
async def test_input_error_or_timeout_of_the_holder_is_shared_by_every_waiter(sfp, ocr_server, case):
    p = sfp
    if case == "corrupt_image":  # header fine, data cut: found by infer's decoder, before the engine
        data, engine_calls, code = (CASES / "img17_truncated.jpg").read_bytes(), 0, ErrorCode.CORRUPT_IMAGE
    else:  # the engine does not answer within infer_timeout_s
        data, engine_calls, code = text_image(["STALLED 7202"]), 1, ErrorCode.TIMEOUT
    p.stop(live(p, "sink"))
    posts = ocr_server.script("NEVER SEEN 7202", stall_next=1 if case == "timeout" else 0)
    calls, events = p.engine_calls(), infer_events(p)
    holder_run, copies_run = await holder_then_copies(p, data)
    p.start("sink")
    [holder] = await holder_run
    copies = await copies_run
    for d in [holder, *copies]:
        assert d.status == "error" and d.error.code is code, (d.status, d.error)
        assert d.error.message == holder.error.message and d.text == "" and not d.cache_hit
    assert p.engine_calls() - calls == engine_calls and ocr_server.posts - posts == engine_calls
    assert infer_events(p) - events == 1  # the holder's only: no waiter was re-sent
    await assert_no_flight_left(holder.cache_key)


async def test_expired_lease_promotes_a_waiter_and_everyone_completes(sfp, ocr_server):
    p = sfp
    data = text_image(["SILENT HOLDER 7303"])
    p.stop(live(p, "dedup"))
    # short enough to wait for, long enough for the copies to join before it runs out
    p.start("dedup", {"OCRSTREAM_LEASE_MS": "10000"})
    p.stop(live(p, "infer"))  # the holder's inference never starts: its lease runs out
    try:
        holder_run, copies_run = await holder_then_copies(p, data)
        infer_topic = p.env["OCRSTREAM_TOPICS__INFER"]

        def promoted_and_sent() -> bool:
            text = p.metrics("dedup")
            return (metric_value(text, "ocrstream_cache_total", outcome="promoted") == 1
                    and metric_value(text, "ocrstream_messages_out_total", topic=infer_topic) == 2)

        await until(promoted_and_sent, "the reaper to promote a waiter and send it to ocr.infer")
        p.stop(live(p, "dedup"))  # no further promotions: exactly two inferences are due
        r, prefix = redis_client()
        try:
            key = r.zrange(f"{prefix}:inflight", 0, -1)
            waiting = [r.llen(f"{prefix}:wait:{k.decode()}") for k in key]
        finally:
            r.close()
        assert waiting == [COPIES - 1], waiting  # one copy left the waiters: it holds the lease now
        posts = ocr_server.script("SILENT HOLDER 7303")
        p.start("infer")  # the holder's and the promoted copy's inference run now
        [holder] = await holder_run
        copies = await copies_run
    finally:
        for name, extra in (("dedup", None), ("infer", None)):
            if not [s for s in p.stages[name] if s.proc.poll() is None]:
                p.start(name, extra)
    for d in [holder, *copies]:
        assert d.status == "ok" and d.text == "SILENT HOLDER 7303", (d.status, d.error, d.text)
    assert not holder.cache_hit and sorted(c.cache_hit for c in copies) == [False, True, True, True]
    # a fresh infer process: its counter holds exactly these two; the server also saw its warm-up
    assert p.engine_calls() == 2 and infer_events(p) == 2 and ocr_server.posts - posts == 1 + 2
    await assert_no_flight_left(holder.cache_key)
