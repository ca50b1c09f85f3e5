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

from services.infer.engines.base import EngineOutput, EngineTimeout
from services.infer.engines.hunyuan import SPOTTING_PROMPT
from services.infer.engines.openai_engine import OpenAiEngine, ServerError

# A recorded-style HunyuanOCR text-spotting answer (0..1000 coordinates).
ANSWER = "INVOICE(100,50),(400,90)\n发票号码(600,52),(800,88)\nTOTAL 97.50(100,900),(500,950)"

OK, SLOW, FLAKY, BROKEN, BAD_REQ, LENGTH, LOOP = 10, 20, 30, 40, 50, 60, 70
# cut at max_tokens mid entry; and a runaway loop of one entry
CUT = "INVOICE(100,50),(400,90)\nTOTAL 97.50(100,9"
LOOPING = "Signature: ________(100,50),(400,90)\n" + "重复(10,40),(90,60)" * 40


class FakeServer:
    def __init__(self, healthy_after: int = 0):
        self.requests: list[dict] = []
        self.health_calls = 0
        self.healthy_after = healthy_after
        self.flaky_failures = 0
        self.lock = threading.Lock()
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
                    time.sleep(1.5)
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
                content, finish = {LENGTH: (CUT, "length"), LOOP: (LOOPING, "stop")}.get(kind, (ANSWER, "stop"))
                self._send(200, {
                    "id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": finish,
                                 "message": {"role": "assistant", "content": content}}],
                })

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

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
    out = await eng.ocr([page(OK, 2000, 1000), page(OK, 1000, 1000)], timeout_s=10)
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
    out = await eng.ocr([page(SLOW), page(OK)], timeout_s=0.5)
    assert time.monotonic() - t0 < 1.4
    assert isinstance(out[0], EngineTimeout)
    assert isinstance(out[1], EngineOutput) and len(out[1].segments) == 3
    await eng.close()


async def test_retry_after_a_500(server):
    eng = engine(server.url, retries=3)
    (out,) = await eng.ocr([page(FLAKY)], timeout_s=10)
    assert isinstance(out, EngineOutput) and len(out.segments) == 3
    assert server.flaky_failures == 2  # failed once, answered on the retry
    await eng.close()


async def test_failing_images_do_not_fail_the_others(server):
    eng = engine(server.url, retries=2)
    out = await eng.ocr([page(BROKEN), page(OK), page(BAD_REQ)], timeout_s=10)
    assert isinstance(out[0], ServerError) and out[0].status == 500
    assert isinstance(out[1], EngineOutput) and len(out[1].segments) == 3
    assert isinstance(out[2], ServerError) and out[2].status == 400
    attempts = [r for r in server.requests]
    assert len(attempts) == 2 + 1 + 1  # 500 retried up to `retries`, 400 never retried
    await eng.close()


async def test_connection_refused_is_an_error_entry():
    eng = engine("http://127.0.0.1:9/v1", retries=2)
    (out,) = await eng.ocr([page(OK)], timeout_s=5)
    assert isinstance(out, Exception) and not isinstance(out, EngineTimeout)
    await eng.close()


async def test_thin_images_are_padded_and_boxes_clipped(server):
    eng = engine(server.url)
    (out,) = await eng.ocr([page(OK, 3000, 10)], timeout_s=10)
    sent = server.requests[-1]["body"]["messages"][1]["content"][0]["image_url"]["url"]
    img = Image.open(io.BytesIO(base64.b64decode(sent.split(",", 1)[1])))
    assert img.size == (3000, 32)
    assert all(y <= 10 for s in out.segments for _, y in s.box)
    await eng.close()


async def test_truncated_answers_are_flagged(server):
    eng = engine(server.url)
    cut, loop, ok = await eng.ocr([page(LENGTH, 1000, 1000), page(LOOP, 1000, 1000), page(OK)], timeout_s=10)
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
    from services.common.settings import EngineIdentity
    from services.infer.settings import InferSettings

    with caplog.at_level("WARNING", logger="services.infer.engines.openai_engine"):
        OpenAiEngine.from_settings(InferSettings(engine_kind="openai", openai_model="my-ocr-vlm"))
    assert [r.getMessage() for r in caplog.records] == [
        "openai: engine.model='PP-OCRv4-ch' (the cache key) differs from openai_model='my-ocr-vlm' (what is asked)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="services.infer.engines.openai_engine"):
        OpenAiEngine.from_settings(InferSettings(
            engine_kind="openai", openai_model="my-ocr-vlm",
            engine=EngineIdentity(engine="openai", model="my-ocr-vlm", model_revision="r1")))
    assert caplog.records == []
