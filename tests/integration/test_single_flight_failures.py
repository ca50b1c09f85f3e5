"""Single flight when the holder fails or a stage stops: waiters are never left hanging.

The policy (``services/dedup/state.py``, ``schemas/errors.py`` ``RETRYABLE_CODES``,
docs/single-flight.md):

* holder ends with ``engine_error`` (retryable): one waiter is promoted and re-sent to inference;
* holder ends with an input error or ``timeout`` (same bytes, same outcome): every waiter shares it;
* infer stopped for a long time: the copies wait in dedup's state; nothing is computed twice;
* dedup killed while copies wait: its state comes back from the changelog and the copies complete.

The engine that fails on demand is real HTTP: infer runs its ``openai`` engine against a small
OpenAI-compatible OCR server on loopback (stdlib, a thread of this process) that answers as
each test scripts it: a 500 (``engine_error``), a stall past ``infer_timeout_s`` (``timeout``),
or a HunyuanOCR text-spotting answer. RapidOCR has no input that makes it raise. Everything else
(Kafka, Redis, MariaDB, S3, the four stage processes) is the real stack.

To make the order deterministic without timing, the tests stop the stage that would settle
the holder (the sink, or infer) until the copies have joined the holder, as dedup's metrics show.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from schemas.errors import ErrorCode
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


def dedup_count(p: Pipeline, outcome: str) -> float:
    return metric_value(p.metrics("dedup"), "ocrstream_cache_total", outcome=outcome)


def dedup_state(p: Pipeline, kind: str) -> float:
    """Dedup's keyed state now: ``in_flight`` keys, ``waiters`` or ``settled`` keys."""
    return metric_value(p.metrics("dedup"), "ocrstream_dedup_state", kind=kind)


def infer_events(p: Pipeline) -> float:
    """``ocr.infer`` events the live infer processes consumed (holders' and promoted waiters')."""
    return metric_value(p.metrics("infer"), "ocrstream_messages_in_total")


async def until(cond, what: str, timeout: float = 120) -> None:
    """Poll ``cond()`` until true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def assert_no_flight_left(p: Pipeline) -> None:
    """Nothing is in flight in dedup's state any more: no key, no waiting copy."""
    await until(lambda: dedup_state(p, "in_flight") == 0 and dedup_state(p, "waiters") == 0, "no key in flight")


async def holder_then_copies(p: Pipeline, data: bytes) -> tuple[asyncio.Task, asyncio.Task]:
    """Submit one request, wait until it is the key's holder, then ``COPIES`` copies and wait until
    every copy joined it. Returns the two runs (holder's, copies')."""
    misses, joined = dedup_count(p, "miss"), dedup_count(p, "joined")
    holder = asyncio.create_task(p.run([(data, "holder.png")], timeout=300))
    await until(lambda: dedup_count(p, "miss") == misses + 1, "the holder to go to inference")
    copies = asyncio.create_task(p.run([(data, f"copy-{i}.png") for i in range(COPIES)], timeout=300))
    await until(lambda: dedup_count(p, "joined") == joined + COPIES, "the copies to join the holder")
    return holder, copies


async def test_engine_error_of_the_holder_promotes_one_waiter(sfp, ocr_server):
    p = sfp
    data = text_image(["PROMOTE ME 7101"])
    p.stop(live(p, "sink"))  # nothing settles the holder until the copies have joined
    # the holder's inference gets an HTTP 500; the promoted copy's is held until we have looked
    posts = ocr_server.script("PROMOTED 7101", fail_next=1, hold_next=1)
    calls, events = p.engine_calls(), infer_events(p)
    holder_run, copies_run = await holder_then_copies(p, data)
    p.start("sink")
    await until(lambda: ocr_server.posts == posts + 2, "the promoted copy's inference")
    try:  # the promoted copy is the key's holder now; the three others still wait on it
        in_flight, waiting = dedup_state(p, "in_flight"), dedup_state(p, "waiters")
        promoted = dedup_count(p, "promoted")
    finally:
        ocr_server.gate.set()
    assert (in_flight, waiting, promoted) == (1, COPIES - 1, 1)
    [holder] = await holder_run
    copies = await copies_run
    assert holder.status == "error" and holder.error.code is ErrorCode.ENGINE_ERROR, holder.error
    for c in copies:
        assert c.status == "ok" and c.text == "PROMOTED 7101", (c.status, c.error, c.text)
    # exactly one copy was promoted and computed; the other three were completed with its result
    assert sorted(c.cache_hit for c in copies) == [False, True, True, True]
    assert p.engine_calls() - calls == 2 and ocr_server.posts - posts == 2 and infer_events(p) - events == 2
    await assert_no_flight_left(p)


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
    await assert_no_flight_left(p)


async def test_a_stopped_infer_never_computes_a_queued_image_twice(sfp, ocr_server):
    """Infer stopped far longer than the old lease period (1.5 s in the old design's test; here 6 s),
    copies submitted meanwhile: they wait in dedup's state (no deadline, nothing to expire), and
    when infer comes back the image is computed once and every copy gets its result."""
    p = sfp
    data = text_image(["QUEUED HOLDER 7303"])
    p.stop(live(p, "infer"))  # the holder waits in ocr.infer
    promoted = dedup_count(p, "promoted")
    try:
        holder_run, copies_run = await holder_then_copies(p, data)
        await asyncio.sleep(6)
        text = p.metrics("dedup")
        assert metric_value(text, "ocrstream_cache_total", outcome="promoted") == promoted
        assert dedup_state(p, "waiters") == COPIES
        sent = metric_value(text, "ocrstream_messages_out_total", topic=p.env["OCRSTREAM_TOPICS__INFER"])
        posts = ocr_server.script("QUEUED HOLDER 7303")
        p.start("infer")
        [holder] = await holder_run
        copies = await copies_run
    finally:
        if not [s for s in p.stages["infer"] if s.proc.poll() is None]:
            p.start("infer")
    for d in [holder, *copies]:
        assert d.status == "ok" and d.text == "QUEUED HOLDER 7303", (d.status, d.error, d.text)
    assert not holder.cache_hit and all(c.cache_hit and c.cache_tier == "single_flight" for c in copies)
    # a fresh infer process: exactly one inference (plus the server's warm-up request)
    assert p.engine_calls() == 1 and infer_events(p) == 1 and ocr_server.posts - posts == 1 + 1
    assert metric_value(p.metrics("dedup"), "ocrstream_messages_out_total", topic=p.env["OCRSTREAM_TOPICS__INFER"]) == sent
    await assert_no_flight_left(p)


async def test_dedup_killed_while_copies_wait_restores_them_from_the_changelog(sfp, ocr_server):
    """SIGKILL of dedup while copies wait on a holder whose result is not settled yet (the sink is
    stopped): the restarted dedup restores the key and its waiters from the changelog (its log
    line and ``ocrstream_dedup_restored_total`` say how many), and the holder's settlement then
    completes every copy with one inference."""
    p = sfp
    data = text_image(["RESTORED 7404"])
    posts = ocr_server.script("RESTORED 7404")
    p.stop(live(p, "sink"))
    calls = p.engine_calls()
    holder_run, copies_run = await holder_then_copies(p, data)
    await until(lambda: ocr_server.posts == posts + 1, "the holder's inference")
    dead = live(p, "dedup")
    p.stop(dead, sig=signal.SIGKILL)
    restarted = p.start("dedup")
    await until(lambda: metric_value(p.metrics("dedup"), "ocrstream_dedup_restored_total", kind="waiters") >= COPIES,
                "the waiting copies restored from the changelog", timeout=60)
    assert metric_value(p.metrics("dedup"), "ocrstream_dedup_restored_total", kind="in_flight") >= 1
    assert "restored partitions" in restarted.log.read_text()
    p.start("sink")
    [holder] = await holder_run
    copies = await copies_run
    for d in [holder, *copies]:
        assert d.status == "ok" and d.text == "RESTORED 7404", (d.status, d.error, d.text)
    assert not holder.cache_hit and all(c.cache_hit for c in copies)
    assert p.engine_calls() - calls == 1 and ocr_server.posts - posts == 1
    await assert_no_flight_left(p)
