"""The HTTP front door on the real stack: upload, long-poll, cached answers, limits, batch."""

from __future__ import annotations

import asyncio
import hashlib
import io
import re
import socket
import time

import httpx
import json
import pytest
from PIL import Image, PngImagePlugin

from tests.conftest import text_image
from tests.integration.conftest import API_BODY_TIMEOUT_S, API_ENV, API_MAX_BYTES
from tests.stack import API, Pipeline

pytestmark = pytest.mark.stack


def _client(api) -> httpx.Client:
    return httpx.Client(base_url=api.url, timeout=90)


@pytest.fixture(scope="module")
def vlm_door(stack_env, tmp_path_factory):
    """A door configured for the ``openai`` engine (which does every task), so a task's parameters
    are checked (on the session's CPU engine ``extract`` and ``translate`` are refused first,
    ``unsupported_task``). Its submissions here are all refused: no infer needs to answer them."""
    p = Pipeline(env=stack_env, logdir=tmp_path_factory.mktemp("vlm-door-logs"))
    door = p.start(API, extra_env={**API_ENV, "OCRSTREAM_ENGINE_KIND": "openai"})
    door.url = f"http://127.0.0.1:{door.port}"
    yield door
    p.stop_all()


def _same_pixels(img: bytes, note: str) -> bytes:
    """``img`` re-encoded as PNG with a text chunk ``note``: other bytes (so another SHA-256 and cache
    key), the same pixels (PNG is lossless), so the engine sees the same input."""
    info = PngImagePlugin.PngInfo()
    info.add_text("ocrstream-test", note)
    buf = io.BytesIO()
    Image.open(io.BytesIO(img)).save(buf, "PNG", pnginfo=info)
    return buf.getvalue()


def test_upload_long_poll_and_cached_repeat_match_the_kafka_path(api, pipeline):
    """The Kafka path and the HTTP door each have the engine read the same pixels (two cache misses:
    the HTTP copy differs by a PNG text chunk only), and their results are identical: text, every
    line's box and confidence, page sizes."""
    img = text_image(["HTTP DESK", "LONG POLL"], size=40)
    twin = _same_pixels(img, f"http-{time.time_ns()}")
    assert twin != img
    assert Image.open(io.BytesIO(twin)).tobytes() == Image.open(io.BytesIO(img)).tobytes()

    # the Kafka path computes the image: a miss
    [kafka_doc] = asyncio.run(pipeline.run([(img, "door.png")]))
    assert kafka_doc.status == "ok" and kafka_doc.cache_hit is False and kafka_doc.near_duplicate_of is None
    assert kafka_doc.content_sha256 == hashlib.sha256(img).hexdigest()
    assert kafka_doc.text == "HTTP DESK\nLONG POLL"

    with _client(api) as c:
        r = c.post("/v1/ocr", content=twin, headers={"Content-Type": "image/png"},
                   params={"source": "web", "filename": "door.png", "metadata": '{"ticket": "T-1"}'})
        assert r.status_code == 202, r.text  # its own cache key: not answered from the Kafka path's result
        body = r.json()
        rid = body["request_id"]
        assert body["status"] == "pending" and body["links"]["self"] == f"/v1/ocr/{rid}"

        t0 = time.monotonic()
        got = c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()
        assert got["status"] == "ok", got
        assert time.monotonic() - t0 < 60  # woken by the completion, not by the timeout
        doc = got["result"]
        assert doc["text"] == "HTTP DESK\nLONG POLL"
        assert doc["source"] == "web" and doc["filename"] == "door.png" and doc["metadata"] == {"ticket": "T-1"}
        assert doc["cache_hit"] is False and doc["near_duplicate_of"] is None  # computed by the engine too
        assert doc["content_sha256"] == hashlib.sha256(twin).hexdigest()

        # the same pixels through Kafka gave exactly the same result (RapidOCR on one thread per image is deterministic)
        assert [ln.model_dump() for ln in kafka_doc.lines] == doc["lines"]
        assert [pg.model_dump() for pg in kafka_doc.pages] == doc["pages"]
        assert (kafka_doc.width, kafka_doc.height) == (doc["width"], doc["height"])
        assert (kafka_doc.engine, kafka_doc.model, kafka_doc.model_revision) == (
            doc["engine"], doc["model"], doc["model_revision"])
        assert kafka_doc.cache_key.split(":")[0] == doc["cache_key"].split(":")[0]  # the same cache generation

        # a repeat is answered at once from the cache, 200 with the full result
        r2 = c.post("/v1/ocr", content=twin, headers={"Content-Type": "image/png"})
        assert r2.status_code == 200, r2.text
        hit = r2.json()
        assert hit["status"] == "ok" and hit["cache_hit"] is True
        assert hit["result"]["text"] == doc["text"] and hit["result"]["lines"] == doc["lines"]
        # ... and still gets its row in MariaDB through the sink
        rid2 = hit["request_id"]
        deadline = time.monotonic() + 60
        while True:
            stored = c.get(f"/v1/ocr/{rid2}", params={"wait": 5}).json()
            if stored["status"] != "pending" or time.monotonic() > deadline:
                break
        assert stored["status"] == "ok" and stored["result"]["cache_hit"] is True
        assert stored["result"]["text"] == doc["text"]


def test_multipart_upload_with_options_and_idempotent_request_id(api):
    img = text_image(["MULTIPART 0815"], size=40)
    rid = f"mp-{time.time_ns()}"
    with _client(api) as c:
        files = {"file": ("form.png", img, "image/png")}
        r = c.post("/v1/ocr", files=files, data={"request_id": rid, "task": "ocr", "source": "form"})
        assert r.status_code == 202, r.text
        assert r.json()["request_id"] == rid
        again = c.post("/v1/ocr", files=files, data={"request_id": rid})  # a retry by the client
        assert again.status_code in (200, 202) and again.json()["request_id"] == rid
        got = c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()
        assert got["status"] == "ok" and got["result"]["text"] == "MULTIPART 0815"
        assert got["result"]["filename"] == "form.png" and got["result"]["source"] == "form"


def test_bad_input_gets_a_specific_error_and_the_next_image_still_goes_through(api):
    with _client(api) as c:
        r = c.post("/v1/ocr", content=b"%!PS-Adobe not an image", headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_format"
        r = c.post("/v1/ocr", content=b"", headers={"Content-Type": "image/png"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "empty_input"
        r = c.post("/v1/ocr", content=b"x", headers={"Content-Type": "text/plain"})
        assert r.status_code == 415
        r = c.post("/v1/ocr", content=text_image(["X"]), headers={"Content-Type": "image/png"},
                   params={"request_id": "bad id with spaces"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        assert "request_id" in r.json()["error"]["message"]
        r = c.post("/v1/ocr", content=text_image(["X"]), headers={"Content-Type": "image/png"},
                   params={"task": "layout"})
        assert r.status_code == 400 and r.json()["error"] == {
            "code": "invalid_request",
            "message": "task 'layout' is not one of this deployment's tasks: ocr, doc_parse, table"}  # what runs here
        r = c.post("/v1/ocr/batch", files=[("files", ("a.png", text_image(["X"]), "image/png"))],
                   data={"task": "layout"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        # the batch reads the query string too, as POST /v1/ocr does (it was ignored: this got the ocr result)
        r = c.post("/v1/ocr/batch", files=[("files", ("a.png", text_image(["X"]), "image/png"))],
                   params={"task": "layout"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("task 'layout' is not one")
        r = c.post("/v1/ocr/batch", files=[("files", ("a.png", text_image(["X"]), "image/png"))],
                   data={"request_id": "mine-1"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        assert r.json()["error"]["message"].startswith("request_id names one image")
        jpeg = text_image(["TRUNCATED"], fmt="JPEG")
        truncated = jpeg[: len(jpeg) // 2]  # header fine, data cut: found by the decoder
        r = c.post("/v1/ocr", content=truncated, headers={"Content-Type": "image/jpeg"})
        assert r.status_code == 202
        bad = c.get(f"/v1/ocr/{r.json()['request_id']}", params={"wait": 60}).json()
        assert bad["status"] == "error" and bad["error"]["code"] == "corrupt_image"
        ok = c.post("/v1/ocr", content=text_image(["NEXT ONE 77"]), headers={"Content-Type": "image/png"}).json()
        got = c.get(f"/v1/ocr/{ok['request_id']}", params={"wait": 60}).json()
        assert got["status"] == "ok" and got["result"]["text"] == "NEXT ONE 77"
        r = c.get("/v1/ocr/no-such-request")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def _raw_http(port: int, head: bytes, body_chunks: list[bytes]) -> tuple[bytes, int]:
    """Send ``head`` then body chunks until the server answers (then wait up to 10 s for its answer,
    the body left incomplete when the chunks do not finish it); returns (status line, body bytes sent)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        s.settimeout(0.2)
        for chunk in body_chunks:
            try:
                data = s.recv(4096)
                if data:
                    return data.split(b"\r\n", 1)[0], sent
            except socket.timeout:
                pass
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        s.settimeout(10)
        return s.recv(4096).split(b"\r\n", 1)[0], sent


def test_task_parameters_are_checked_at_the_door_with_the_reason(vlm_door):
    """``fields`` (comma-separated, a JSON list, repeated) and ``to``: 400 ``invalid_request``
    saying why, for a raw body, a multipart form and a batch alike; nothing is sent on."""
    png = text_image(["TASK PARAMS 7"])
    fifty_one = [f"field {i}" for i in range(51)]
    with _client(vlm_door) as c:
        cases = [
            (dict(params={"task": "extract", "fields": ",".join(fifty_one)}), "fields: at most 50 fields (51 given)"),
            (dict(params=[("task", "extract")] + [("fields", f) for f in fifty_one]), "at most 50 fields (51 given)"),
            (dict(params={"task": "extract", "fields": json.dumps(fifty_one)}), "at most 50 fields (51 given)"),
            (dict(params={"task": "extract"}), "task 'extract' needs fields"),
            (dict(params={"task": "translate", "to": "xx"}), "target_lang 'xx' is not one of: en, zh"),
            (dict(params={"task": "translate", "target_lang": "xx"}), "target_lang 'xx' is not one of: en, zh"),
            (dict(params={"task": "ocr", "to": "en"}), "task 'ocr' takes no target_lang"),
        ]
        for kw, why in cases:
            r = c.post("/v1/ocr", content=png, headers={"Content-Type": "image/png"}, **kw)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (kw, r.text)
            assert why in r.json()["error"]["message"], (kw, r.json())
        r = c.post("/v1/ocr", files=[("file", ("a.png", png, "image/png"))],
                   data={"task": "extract", "fields": fifty_one})  # the form field repeated
        assert r.status_code == 400 and "at most 50 fields (51 given)" in r.json()["error"]["message"]
        r = c.post("/v1/ocr/batch", files=[("files", ("a.png", png, "image/png"))], data={"task": "translate", "to": "xx"})
        assert r.status_code == 400 and r.json()["error"] == {
            "code": "invalid_request",
            "message": "target_lang 'xx' is not one of: en, zh, ja, ko, fr, de, es, it, pt, ru, ar, vi, th"}


def test_oversize_upload_is_refused_before_the_body_is_read(api):
    """The 413 comes while the body is still incomplete, so the server cannot have waited for it (it
    would answer 408 after ``OCRSTREAM_HTTP_BODY_TIMEOUT_S``, or keep reading, instead)."""
    port = api.port
    # declared too large: the head alone, not one byte of the body, gets the 413
    head = (f"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            f"Content-Length: {API_MAX_BYTES * 50}\r\n\r\n").encode()
    status, sent = _raw_http(port, head, [])
    assert status.split(b" ")[1] == b"413", status
    assert sent == 0
    # chunked, no length: the limit plus one chunk (never the end of the body) gets the 413
    chunk = b"\0" * 65536
    head = b"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nTransfer-Encoding: chunked\r\n\r\n"
    framed = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    n = API_MAX_BYTES // len(chunk) + 1  # the first chunk count past the limit
    status, sent = _raw_http(port, head, [framed] * n)
    assert status.split(b" ")[1] == b"413", status
    assert sent <= (API_MAX_BYTES // len(chunk) + 1) * len(framed) < API_MAX_BYTES + 2 * len(framed), sent


def _rest_of_response(s: socket.socket, got: bytes) -> bytes:
    """The bytes of an HTTP/1.1 response still to come after ``got``: the rest of the head and
    of a ``Content-Length`` body (which may arrive in a later segment than the head)."""
    more = b""
    while True:
        data = got + more
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            length = re.search(rb"(?im)^content-length: *(\d+)", data[:end])
            if len(data) >= end + 4 + (int(length.group(1)) if length else 0):
                return more
        chunk = s.recv(4096)
        if not chunk:
            return more
        more += chunk


def test_a_body_trickling_in_is_cut_off_with_408(api):
    """A client that sends headers and a few bytes, then nothing (slowloris), is answered 408
    once the body deadline passes, and its connection and upload budget are freed."""
    head = b"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 1000\r\n\r\n"
    with socket.create_connection(("127.0.0.1", api.port), timeout=API_BODY_TIMEOUT_S * 5) as s:
        s.sendall(head + b"\x89PNG")
        t0 = time.monotonic()
        answer = s.recv(4096)
        waited = time.monotonic() - t0
        answer += _rest_of_response(s, answer)
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"408", answer[:200]
    assert b'"code":"request_timeout"' in answer
    assert waited >= API_BODY_TIMEOUT_S - 1


def test_batch_upload_one_item_per_file(api):
    imgs = [text_image([f"BATCH ITEM {i}"], size=40) for i in range(3)]
    with _client(api) as c:
        files = [("files", (f"b{i}.png", img, "image/png")) for i, img in enumerate(imgs)]
        files.append(("files", ("junk.bin", b"not an image at all", "application/octet-stream")))
        r = c.post("/v1/ocr/batch", files=files, data={"source": "batch"})
        assert r.status_code == 202, r.text
        items = r.json()["items"]
        assert [it["index"] for it in items] == [0, 1, 2, 3]
        assert items[3]["status"] == "error" and items[3]["error"]["code"] == "unsupported_format"
        texts = []
        for it in items[:3]:
            got = c.get(f"/v1/ocr/{it['request_id']}", params={"wait": 60}).json()
            assert got["status"] == "ok"
            texts.append(got["result"]["text"])
        assert texts == ["BATCH ITEM 0", "BATCH ITEM 1", "BATCH ITEM 2"]


def test_health_and_metrics(api):
    with _client(api) as c:
        assert c.get("/healthz").json() == {"ok": True, "not_ready": []}
        assert c.get("/readyz").status_code == 200
        text = c.get("/metrics").text
        assert "ocrstream_http_requests_total" in text


def _requests_with_id(rid: str) -> int:
    """How many RequestEvents for ``rid`` are on this namespace's ``ocr.requests`` (read from the start;
    the settlements the sink writes there are not counted)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from services.common.kafka import topic_partitions
    from services.common.cache.keys import CacheKeySettings

    async def count() -> int:
        s = CacheKeySettings()
        c = AIOKafkaConsumer(bootstrap_servers=s.kafka.bootstrap_servers, enable_auto_commit=False)
        await c.start()
        try:
            tps = [TopicPartition(s.topics.requests, p) for p in c.partitions_for_topic(s.topics.requests) or []]
            if not tps:
                tps = [TopicPartition(s.topics.requests, p)
                       for p in await topic_partitions(s.kafka, s.topics.requests, "ocrstream-test")]
            c.assign(tps)
            await c.seek_to_beginning(*tps)
            ends = await c.end_offsets(tps)
            n = 0
            while any(pos < ends[tp] for tp, pos in zip(tps, [await c.position(tp) for tp in tps])):
                for recs in (await c.getmany(timeout_ms=1000)).values():
                    n += sum(1 for r in recs if f'"request_id":"{rid}"'.encode() in r.value
                             and b'"schema":"ocr.request.v1"' in r.value)  # not the key's settlement
            return n
        finally:
            await c.stop()

    return asyncio.run(count())


def test_concurrent_twins_with_one_new_request_id_are_sent_once(api):
    import concurrent.futures

    img = text_image(["TWIN 5151"], size=40)
    rid = f"twin-{time.time_ns()}"

    def post(_):
        with _client(api) as c:
            return c.post("/v1/ocr", content=img, headers={"Content-Type": "image/png"}, params={"request_id": rid})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(8)))
    assert sorted({r.status_code for r in answers}) == [202], [r.text for r in answers]
    assert {r.json()["request_id"] for r in answers} == {rid}
    with _client(api) as c:
        got = c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()
    assert got["status"] == "ok" and got["result"]["text"] == "TWIN 5151"
    assert _requests_with_id(rid) == 1


def test_a_request_id_reused_for_a_different_image_is_refused_with_409(api):
    """A client-chosen ``request_id`` already used for another image (another content SHA-256) is
    409 ``request_id_conflict``, while pending (Redis's marker) and once finished (MariaDB's row),
    instead of the first image's result; the same image is an idempotent retry."""
    rid = f"reuse-{time.time_ns()}"
    first, other = text_image(["FIRST 7373"], size=40), text_image(["OTHER 8484"], size=40)
    png = {"Content-Type": "image/png"}
    with _client(api) as c:
        r = c.post("/v1/ocr", content=first, headers=png, params={"request_id": rid})
        assert r.status_code == 202, r.text
        clash = c.post("/v1/ocr", content=other, headers=png, params={"request_id": rid})
        assert clash.status_code == 409, clash.text
        err = clash.json()["error"]
        assert err["code"] == "request_id_conflict"
        assert err["message"].startswith(f"request_id {rid!r} is already used for a different image")
        got = c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()
        assert got["status"] == "ok" and got["result"]["text"] == "FIRST 7373"
        for _ in range(100):  # the sink's row (the completion may arrive first)
            if c.post("/v1/ocr", content=first, headers=png, params={"request_id": rid}).status_code == 200:
                break
            time.sleep(0.1)
        files = {"file": ("other.png", other, "image/png")}
        late = c.post("/v1/ocr", files=files, data={"request_id": rid})
        assert late.status_code == 409 and late.json()["error"]["code"] == "request_id_conflict", late.text
        same = c.post("/v1/ocr", content=first, headers=png, params={"request_id": rid})
        assert same.status_code == 200 and same.json()["result"]["text"] == "FIRST 7373", same.text
    assert _requests_with_id(rid) == 1


def test_a_refused_submission_frees_its_request_id_for_the_retry(api):
    rid = f"retry-{time.time_ns()}"
    with _client(api) as c:
        bad = c.post("/v1/ocr", content=b"not an image", headers={"Content-Type": "image/png"}, params={"request_id": rid})
        assert bad.status_code == 415
        good = c.post("/v1/ocr", content=text_image(["RETRY 6262"]), headers={"Content-Type": "image/png"},
                      params={"request_id": rid})
        assert good.status_code == 202, good.text
        got = c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()
    assert got["status"] == "ok" and got["result"]["text"] == "RETRY 6262"
