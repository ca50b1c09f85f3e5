"""Single flight when the lease holder fails: waiters are never left hanging (issue #3).

The policy (``services/sink/handler.py``, ``schemas/errors.py`` ``RETRYABLE_CODES``, README
"Single flight and the cache"):

* holder ends with ``engine_error`` (retryable): one waiter is promoted and re-sent to inference;
* holder ends with an input error or ``timeout`` (same bytes, same outcome): every waiter shares it;
* holder still queued when its lease deadline passes (a backlog, a stopped infer): the reaper
  extends the lease, and the image is computed once;
* holder's completion lost (nothing of it queued, key never completed): the reaper promotes one waiter.

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
import hashlib
import os
import threading
import time
from http.server import ThreadingHTTPServer

import pytest
import redis

from schemas.errors import ErrorCode
from services.common.cache import ResultCache
from services.common.settings import RedisSettings
from tests.conftest import CASES, text_image
from tests.stack import JsonStubHandler, Pipeline, Stage, free_port, metric_value, namespaced_pipeline

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

        class Handler(JsonStubHandler):
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
        [(key, deadline_ms)] = r.zrange(f"{prefix}:inflight", 0, -1, withscores=True)
        deadline_left = deadline_ms - time.time() * 1000
        backstop_left = r.pttl(f"{prefix}:lease:{key.decode()}")  # the lease key's own expiry: 4 periods
        waiting = r.llen(f"{prefix}:wait:{key.decode()}")
    finally:
        r.close()
        ocr_server.gate.set()
    assert 0 < deadline_left <= 120_000 and 360_000 < backstop_left <= 480_000 and waiting == COPIES - 1, \
        (deadline_left, backstop_left, waiting)
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


async def test_a_holder_queued_past_its_lease_keeps_it_and_computes_once(sfp, ocr_server):
    """A backlog (here: infer stopped) longer than the lease must not make copies into several
    inferences: dedup's reaper sees the holder's event still uncommitted in ``ocr.infer`` and
    extends the lease, lease period after lease period, instead of promoting a waiter; and the
    waiters, which exist only in Redis, never expire while they wait."""
    p = sfp
    data = text_image(["QUEUED HOLDER 7303"])
    p.stop(live(p, "dedup"))
    p.start("dedup", {"OCRSTREAM_LEASE_MS": "1500"})
    p.stop(live(p, "infer"))  # the holder waits in ocr.infer, many lease periods long
    try:
        holder_run, copies_run = await holder_then_copies(p, data)
        extended = dedup_count(p, "extended")
        await until(lambda: dedup_count(p, "extended") >= extended + 4, "four extensions of the holder's lease")
        r, prefix = redis_client()
        try:
            [key] = [k.decode() for k in r.zrange(f"{prefix}:inflight", 0, -1)]
            waiting, waiters_ttl = r.llen(f"{prefix}:wait:{key}"), r.pttl(f"{prefix}:wait:{key}")
        finally:
            r.close()
        assert waiting == COPIES and waiters_ttl == -1, (waiting, waiters_ttl)  # all still there, no expiry
        text = p.metrics("dedup")
        assert metric_value(text, "ocrstream_cache_total", outcome="promoted") == 0
        assert metric_value(text, "ocrstream_messages_out_total", topic=p.env["OCRSTREAM_TOPICS__INFER"]) == 1
        posts = ocr_server.script("QUEUED HOLDER 7303")
        p.start("infer")
        [holder] = await holder_run
        copies = await copies_run
    finally:
        for name in ("dedup", "infer"):
            if not [s for s in p.stages[name] if s.proc.poll() is None]:
                p.start(name)
    for d in [holder, *copies]:
        assert d.status == "ok" and d.text == "QUEUED HOLDER 7303", (d.status, d.error, d.text)
    assert not holder.cache_hit and all(c.cache_hit for c in copies)
    # a fresh infer process: exactly one inference (plus the server's warm-up request)
    assert p.engine_calls() == 1 and infer_events(p) == 1 and ocr_server.posts - posts == 1 + 1
    await assert_no_flight_left(holder.cache_key)


async def test_a_holder_that_never_completes_is_replaced_by_a_waiter(sfp, ocr_server):
    """A holder whose completion was lost (nothing of it is queued any more, yet its key was never
    completed: e.g. a sink that deferred the completion while Redis was down, then died) must
    not leave its waiters hanging: once the deadline has passed and neither ``ocr.infer`` nor
    ``ocr.results`` holds anything uncommitted on the key's partitions, the reaper promotes the
    first waiter, whose inference completes the others."""
    p = sfp
    # the namespace's generation id, from a request that went through (the key is <gen_id>:<sha256>)
    posts = ocr_server.script("WARM 7404")
    [warm] = await p.run([(text_image(["WARM 7404"]), "warm.png")], timeout=300)
    assert warm.status == "ok", warm.error
    gen_id = warm.cache_key.rsplit(":", 1)[0]
    data = text_image(["LOST HOLDER 7404"])
    key = f"{gen_id}:{hashlib.sha256(data).hexdigest()}"
    cache = ResultCache(RedisSettings(key_prefix=os.environ["OCRSTREAM_REDIS__KEY_PREFIX"]))
    try:  # a holder nobody will ever complete: its lease is in Redis, its events are nowhere
        claim = await cache.claim(key, "lost-holder", b'{"request_id": "lost-holder"}', lease_ms=5000)
        assert claim.outcome == "lead"
    finally:
        await cache.close()
    promoted, joined, calls = dedup_count(p, "promoted"), dedup_count(p, "joined"), p.engine_calls()
    posts = ocr_server.script("LOST HOLDER 7404")
    copies = await p.run([(data, f"copy-{i}.png") for i in range(COPIES)], timeout=300)
    for c in copies:
        assert c.status == "ok" and c.text == "LOST HOLDER 7404", (c.status, c.error, c.text)
        assert c.cache_key == key
    assert dedup_count(p, "joined") - joined == COPIES  # every copy waited on the lost holder
    assert dedup_count(p, "promoted") - promoted == 1
    assert sorted(c.cache_hit for c in copies) == [False, True, True, True]
    assert p.engine_calls() - calls == 1 and ocr_server.posts - posts == 1
    await assert_no_flight_left(key)


async def test_a_promoted_waiter_whose_event_was_never_sent_is_sent_again(sfp, ocr_server):
    """A promotion pops a waiter from Redis and makes it the holder; the event that sends it to
    inference is produced only after the reply. If the reply is lost (Redis slow past its budget)
    or the promoting process dies first, that request is in no topic and in no waiter list. The
    reaper must find it (its deadline passes with nothing of it uncommitted in Kafka) and send it
    again, not pass it over for the next waiter: every copy completes, with one inference."""
    p = sfp
    posts = ocr_server.script("WARM 7505")
    [warm] = await p.run([(text_image(["WARM 7505"]), "warm.png")], timeout=300)
    assert warm.status == "ok", warm.error
    data = text_image(["NEVER SENT 7505"])
    key = f"{warm.cache_key.rsplit(':', 1)[0]}:{hashlib.sha256(data).hexdigest()}"
    cache = ResultCache(RedisSettings(key_prefix=os.environ["OCRSTREAM_REDIS__KEY_PREFIX"]))
    try:
        # a holder whose inference failed retryably: nothing of it is left in Kafka
        assert (await cache.claim(key, "failed-holder", b'{"request_id": "failed-holder"}', lease_ms=5000)).outcome == "lead"
        resent, promoted, joined, calls = (dedup_count(p, "resent"), dedup_count(p, "promoted"),
                                           dedup_count(p, "joined"), p.engine_calls())
        posts = ocr_server.script("NEVER SENT 7505")
        run = asyncio.create_task(p.run([(data, f"copy-{i}.png") for i in range(COPIES)], timeout=300))
        await until(lambda: dedup_count(p, "joined") == joined + COPIES, "the copies to join the lease")
        # the sink's promotion after that error: it took the first copy, and its reply was lost
        outcome, first, *_ = await cache.promote(key, 5000, expected_holder="failed-holder")
        assert outcome == "promoted"
    finally:
        await cache.close()
    copies = await run
    for c in copies:
        assert c.status == "ok" and c.text == "NEVER SENT 7505" and c.cache_key == key, (c.status, c.error, c.text)
    [sent_again] = [c for c in copies if not c.cache_hit]
    assert first.decode().count(sent_again.request_id) == 1  # the promoted copy is the one computed
    assert dedup_count(p, "resent") - resent == 1 and dedup_count(p, "promoted") - promoted == 0
    assert p.engine_calls() - calls == 1 and ocr_server.posts - posts == 1
    await assert_no_flight_left(key)
