"""OpenAiEngine against a small fake OpenAI-compatible server on 127.0.0.1 (stdlib, in a thread).

The server mimics vLLM's /health, /v1/models and /v1/chat/completions; what it answers is
chosen per request by the image's first pixel (red channel), so one batch can hold images that
succeed, time out and fail.
"""

import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from tests.engines import read_all
from services.common.errors import is_transient
from services.common.cache.prompts import SPOTTING_PROMPT
from services.infer.engines.base import OCR
from services.infer.engines.base import EngineOutput, EngineTimeout, EngineUnavailable
from services.infer.engines.openai_engine import AttemptTimeout, OpenAiEngine, ServerError, parse_retry_after

# A recorded-style HunyuanOCR text-spotting answer (0..1000 coordinates).
ANSWER = "INVOICE(100,50),(400,90)\n发票号码(600,52),(800,88)\nTOTAL 97.50(100,900),(500,950)"

OK, SLOW, FLAKY, BROKEN, BAD_REQ, LENGTH, LOOP, PROSE, BUSY, GATED = 10, 20, 30, 40, 50, 60, 70, 80, 90, 100
PROSE_ANSWER = "I can see a receipt.\nThe total is 97.50 EUR."
# cut at max_tokens mid entry; and a runaway loop of one entry
CUT = "INVOICE(100,50),(400,90)\nTOTAL 97.50(100,9"
LOOPING = "Signature: ________(100,50),(400,90)\n" + "重复(10,40),(90,60)" * 40


class FakeServer:
    def __init__(self, healthy_after: int = 0, port: int = 0):
        self.requests: list[dict] = []
        self.inflight = 0  # GATED requests being answered now
        self.max_inflight = 0
        self.arrived = 0
        self.gate_at = 1  # GATED requests are answered in waves of this many (each waits at most 5 s)
        self.cond = threading.Condition()
        self.health_calls = 0
        self.healthy_after = healthy_after
        self.flaky_failures = 0
        self.lock = threading.Lock()
        self.canned: dict[str, tuple[str, str]] = {}  # prompt text -> (answer, finish_reason)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj, ensure_ascii=False).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                with fake.lock:
                    fake.health_calls += 1
                    up = fake.health_calls > fake.healthy_after
                if not up:
                    self._send(503, {"error": "loading"})
                elif self.path == "/health":
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path == "/v1/models":
                    self._send(200, {"data": [{"id": "tencent/HunyuanOCR"}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append({"body": body, "auth": self.headers.get("Authorization")})
                url = body["messages"][1]["content"][0]["image_url"]["url"]
                img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
                kind = img.getpixel((0, 0))[0]
                if kind == SLOW:
                    time.sleep(3.0)
                elif kind == FLAKY:
                    with fake.lock:
                        fake.flaky_failures += 1
                        fail = fake.flaky_failures == 1
                    if fail:
                        return self._send(500, {"error": "engine hiccup"})
                elif kind == BROKEN:
                    return self._send(500, {"error": "always broken"})
                elif kind == BAD_REQ:
                    return self._send(400, {"error": "bad image"})
                elif kind == BUSY:
                    data = b'{"error": "slow down"}'
                    self.send_response(429)
                    self.send_header("Retry-After", "7")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    return self.wfile.write(data)
                elif kind == GATED:
                    with fake.cond:
                        fake.inflight += 1
                        fake.arrived += 1
                        fake.max_inflight = max(fake.max_inflight, fake.inflight)
                        wave_end = ((fake.arrived - 1) // fake.gate_at + 1) * fake.gate_at
                        fake.cond.notify_all()
                        fake.cond.wait_for(lambda: fake.arrived >= wave_end, timeout=5)
                        fake.inflight -= 1
                content, finish = {LENGTH: (CUT, "length"), LOOP: (LOOPING, "stop"),
                                   PROSE: (PROSE_ANSWER, "stop")}.get(kind, (ANSWER, "stop"))
                prompt = body["messages"][1]["content"][1]["text"]
                if prompt in fake.canned:  # a canned answer per task's prompt
                    content, finish = fake.canned[prompt]
                self._send(200, {
                    "id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": finish,
                                 "message": {"role": "assistant", "content": content}}],
                })

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        # polled every 50 ms: shutdown() waits out one poll (0.5 s by default, per test)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def page(kind: int, w: int = 200, h: int = 100) -> np.ndarray:
    img = np.full((h, w, 3), 255, dtype=np.uint8)
    img[0, 0] = (kind, 0, 0)
    return img


def engine(url: str, **kw) -> OpenAiEngine:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("ready_poll_s", 0.05)
    return OpenAiEngine(url, "tencent/HunyuanOCR", **kw)


@pytest.fixture
def server():
    with FakeServer() as srv:
        yield srv


async def test_start_waits_for_health_then_warms_up():
    with FakeServer(healthy_after=3) as srv:
        eng = engine(srv.url, api_key="sk-test")
        await eng.start()
        assert eng.ready and await eng.health()
        assert srv.health_calls >= 4
        assert len(srv.requests) == 1  # the warm-up image
        req = srv.requests[0]
        assert req["auth"] == "Bearer sk-test"
        body = req["body"]
        assert body["model"] == "tencent/HunyuanOCR" and body["temperature"] == 0.0
        # vLLM's HunyuanOCR recipe: greedy, top_k 1, no repetition penalty
        assert body["top_k"] == 1 and body["repetition_penalty"] == 1.0
        assert body["messages"][0] == {"role": "system", "content": ""}
        assert body["messages"][1]["content"][1] == {"type": "text", "text": SPOTTING_PROMPT}
        await eng.close()


async def test_start_gives_up_when_server_never_answers():
    eng = engine("http://127.0.0.1:9/v1", ready_timeout_s=0.3)
    with pytest.raises(RuntimeError, match="not ready"):
        await eng.start()
    await eng.close()


async def test_batch_parses_answer_into_pixel_boxes(server):
    eng = engine(server.url)
    out = await read_all(eng, [page(OK, 2000, 1000), page(OK, 1000, 1000)], OCR, timeout_s=10)
    assert all(isinstance(o, EngineOutput) for o in out)
    first = out[0].segments
    assert [(s.text, s.box) for s in first] == [
        ("INVOICE", [[200.0, 50.0], [800.0, 50.0], [800.0, 90.0], [200.0, 90.0]]),
        ("发票号码", [[1200.0, 52.0], [1600.0, 52.0], [1600.0, 88.0], [1200.0, 88.0]]),
        ("TOTAL 97.50", [[200.0, 900.0], [1000.0, 900.0], [1000.0, 950.0], [200.0, 950.0]]),
    ]
    assert out[1].segments[0].box[1] == [400.0, 50.0]
    assert out[0].inference_ms > 0
    await eng.close()


async def test_per_image_timeout_does_not_fail_the_batch(server):
    eng = engine(server.url)
    t0 = time.monotonic()
    out = await read_all(eng, [page(SLOW), page(OK)], OCR, timeout_s=0.5)
    assert time.monotonic() - t0 < 2.5  # cut at 0.5 s, not waited for (the slow page takes 3 s)
    assert type(out[0]) is EngineTimeout and str(out[0]) == "inference took longer than 0.5 s"
    assert isinstance(out[1], EngineOutput) and len(out[1].segments) == 3
    await eng.close()


async def test_retry_after_a_500(server):
    eng = engine(server.url, retries=3)
    (out,) = await read_all(eng, [page(FLAKY)], OCR, timeout_s=10)
    assert isinstance(out, EngineOutput) and len(out.segments) == 3
    assert server.flaky_failures == 2  # failed once, answered on the retry
    await eng.close()


async def test_failing_images_do_not_fail_the_others(server):
    eng = engine(server.url, retries=2)
    out = await read_all(eng, [page(BROKEN), page(OK), page(BAD_REQ)], OCR, timeout_s=10)
    assert isinstance(out[0], ServerError) and out[0].status == 500
    assert isinstance(out[1], EngineOutput) and len(out[1].segments) == 3
    assert isinstance(out[2], ServerError) and out[2].status == 400
    attempts = [r for r in server.requests]
    assert len(attempts) == 2 + 1 + 1  # 500 retried up to `retries`, 400 never retried
    await eng.close()


async def test_connection_refused_raises_a_retriable_error():
    """A server that is down is no image's fault: the call raises (nothing is committed, the
    infer runner backs off and retries the batch) instead of returning engine errors."""
    eng = engine("http://127.0.0.1:9/v1", retries=2)
    with pytest.raises(EngineUnavailable, match="unreachable") as err:
        await read_all(eng, [page(OK), page(OK)], OCR, timeout_s=5)
    assert is_transient(err.value) and err.value.took_down is False
    await eng.close()


async def test_a_server_that_dies_holding_the_image_is_told_apart_from_one_already_down():
    """The infer handler counts an outage against an image only when the server went away while
    it held that image: the connection carrying it dropped mid-exchange, then the retry was
    refused (``took_down``). A server refusing the first connection was down already."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def die_on_first_request():
        conn, _ = listener.accept()
        conn.recv(65536)  # the request has arrived ...
        listener.close()  # ... and the process dies: the port refuses from now on
        conn.close()

    threading.Thread(target=die_on_first_request, daemon=True).start()
    eng = engine(f"http://127.0.0.1:{port}/v1", retries=2)
    with pytest.raises(EngineUnavailable) as died:
        await read_all(eng, [page(OK)], OCR, timeout_s=5)
    assert died.value.took_down is True
    with pytest.raises(EngineUnavailable) as down:  # still down: refused at once, held nothing
        await read_all(eng, [page(OK)], OCR, timeout_s=5)
    assert down.value.took_down is False
    await eng.close()


async def test_dns_failure_raises_a_retriable_error():
    eng = engine("http://ocr-server.invalid:8000/v1", retries=1)
    with pytest.raises(EngineUnavailable):
        await read_all(eng, [page(OK)], OCR, timeout_s=5)
    await eng.close()


async def test_server_stopped_then_started_again():
    """A real loopback server goes away after start-up: calls raise EngineUnavailable and the
    engine is not ready (also by its health check); once the server listens again on the same
    port, ready comes back and the same image ends ok with the right text."""
    with FakeServer() as srv:
        port = srv.httpd.server_address[1]
        eng = engine(srv.url, retries=2)
        await eng.start()
        assert eng.ready
    # stopped: nothing listens on the port any more
    with pytest.raises(EngineUnavailable):
        await read_all(eng, [page(OK), page(OK)], OCR, timeout_s=5)
    assert not eng.ready
    assert await eng.health() is False and not eng.ready
    with FakeServer(port=port) as again:
        assert await eng.health() is True and eng.ready
        out = await read_all(eng, [page(OK, 2000, 1000)], OCR, timeout_s=10)
        assert [s.text for s in out[0].segments] == ["INVOICE", "发票号码", "TOTAL 97.50"]
        assert len(again.requests) == 1
    with pytest.raises(EngineUnavailable):  # down again: a successful call is what brings it back
        await read_all(eng, [page(OK)], OCR, timeout_s=5)
    assert not eng.ready
    with FakeServer(port=port):
        (ok,) = await read_all(eng, [page(OK)], OCR, timeout_s=10)
        assert isinstance(ok, EngineOutput) and len(ok.segments) == 3 and eng.ready
    await eng.close()


async def test_a_500_answer_stays_that_images_error(server):
    """Up but failing one image (HTTP 5xx answer) is that image's engine_error, not an outage."""
    eng = engine(server.url, retries=1)
    await eng.start()
    broken, ok = await read_all(eng, [page(BROKEN), page(OK)], OCR, timeout_s=10)
    assert isinstance(broken, ServerError) and broken.status == 500 and not is_transient(broken)
    assert isinstance(ok, EngineOutput) and eng.ready
    await eng.close()


async def test_per_attempt_socket_timeout_is_reported_as_such(server):
    eng = engine(server.url, request_timeout_s=0.3, retries=3)
    (out,) = await read_all(eng, [page(SLOW)], OCR, timeout_s=10)
    assert type(out) is AttemptTimeout and isinstance(out, EngineTimeout)
    assert "within the 0.3 s socket timeout of one attempt" in str(out)
    assert len(server.requests) == 1  # a timeout is not retried
    await eng.close()


async def test_requests_in_flight_equal_the_batch_up_to_the_cap(server):
    server.gate_at = 4
    eng = engine(server.url)  # cap 32
    out = await read_all(eng, [page(GATED) for _ in range(4)], OCR, timeout_s=20)
    assert all(isinstance(o, EngineOutput) for o in out)
    assert server.max_inflight == 4
    await eng.close()
    server.max_inflight, server.arrived, server.gate_at = 0, 0, 3
    eng = engine(server.url, max_concurrency=3)
    out = await read_all(eng, [page(GATED) for _ in range(6)], OCR, timeout_s=20)
    assert all(isinstance(o, EngineOutput) for o in out)
    assert server.max_inflight == 3
    await eng.close()


async def test_retry_after_is_read_from_the_answer(server):
    eng = engine(server.url, retries=1)
    (out,) = await read_all(eng, [page(BUSY)], OCR, timeout_s=10)
    assert isinstance(out, ServerError) and out.status == 429 and out.retry_after == 7.0
    await eng.close()


def test_retry_waits_honour_retry_after_capped_and_backoff_is_jittered():
    eng = OpenAiEngine(backoff_s=1.0, backoff_max_s=8.0, retry_after_max_s=5.0)
    assert eng._delay(1, ServerError(429, "", retry_after=3.0)) == 3.0
    assert eng._delay(1, ServerError(503, "", retry_after=120.0)) == 5.0
    waits = {attempt: [eng._delay(attempt, ServerError(502, "", retry_after=3.0)) for _ in range(200)]
             for attempt in (1, 2, 3, 4, 5)}
    for attempt, base in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0)):
        assert all(base / 2 <= w <= base for w in waits[attempt]), attempt  # 502: Retry-After not used
        assert len(set(waits[attempt])) > 1  # jittered
    assert parse_retry_after("7") == 7.0 and parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
    eng._pool.shutdown()
    eng._probe_pool.shutdown()


async def test_an_answer_without_entries_is_kept_and_flagged(server):
    eng = engine(server.url)
    (out,) = await read_all(eng, [page(PROSE, 300, 100)], OCR, timeout_s=10)
    assert out.warnings == ("unparsed_output",)
    assert [(s.text, s.box, s.confidence) for s in out.segments] == [
        ("I can see a receipt. The total is 97.50 EUR.", [[0.0, 0.0], [300.0, 0.0], [300.0, 100.0], [0.0, 100.0]], 0.0)]
    await eng.close()


async def test_thin_images_are_padded_and_boxes_clipped(server):
    eng = engine(server.url)
    (out,) = await read_all(eng, [page(OK, 3000, 10)], OCR, timeout_s=10)
    sent = server.requests[-1]["body"]["messages"][1]["content"][0]["image_url"]["url"]
    img = Image.open(io.BytesIO(base64.b64decode(sent.split(",", 1)[1])))
    assert img.size == (3000, 32)
    assert all(y <= 10 for s in out.segments for _, y in s.box)
    await eng.close()


async def test_truncated_answers_are_flagged(server):
    eng = engine(server.url)
    cut, loop, ok = await read_all(eng, [page(LENGTH, 1000, 1000), page(LOOP, 1000, 1000), page(OK)], OCR, timeout_s=10)
    assert [s.text for s in cut.segments] == ["INVOICE"] and cut.warnings == ("truncated_max_tokens",)
    assert [s.text for s in loop.segments] == ["Signature: ________", "重复"]
    assert loop.warnings == ("truncated_repetition",)
    assert len(ok.segments) == 3 and ok.warnings == ()
    await eng.close()


def test_max_side_follows_the_setting():
    from services.infer.settings import InferSettings

    assert OpenAiEngine.from_settings(InferSettings(engine_kind="openai")).max_side == 2048
    assert OpenAiEngine.from_settings(InferSettings(engine_kind="openai", engine_max_side=1280)).max_side == 1280


def test_a_cache_key_naming_another_model_is_reported(caplog):
    from services.common.cache.keys import EngineIdentity
    from services.infer.settings import InferSettings

    with caplog.at_level("WARNING", logger="services.infer.engines.openai_engine"):
        OpenAiEngine.from_settings(InferSettings(engine_kind="openai", openai_model="my-ocr-vlm"))
    assert [r.getMessage() for r in caplog.records] == [
        "openai: engine.model='PP-OCRv6-small' (the cache key) differs from openai_model='my-ocr-vlm' (what is asked)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="services.infer.engines.openai_engine"):
        OpenAiEngine.from_settings(InferSettings(
            engine_kind="openai", openai_model="my-ocr-vlm",
            engine=EngineIdentity(engine="openai", model="my-ocr-vlm", model_revision="r1")))
    assert caplog.records == []
