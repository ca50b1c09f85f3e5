"""``GET /v1/events`` (server-sent events) of the HTTP door on the real stack: a batch watched on one
connection, finished and unknown ids, limits, keep-alives, time-outs and a client that leaves."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import orjson
import pytest

from services.common.cache.entries import ResultCache
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.integration.conftest import API_ENV
from tests.stack import API, metric_value

pytestmark = pytest.mark.stack

#: The small door's limits: 3 waiters in all, a keep-alive after half a second of silence.
SMALL_MAX_WAITERS = 3
SMALL_KEEPALIVE_S = 0.5


@pytest.fixture(scope="module")
def small_door(pipeline):
    """A second HTTP door holding at most 3 waiters, with quick keep-alives."""
    st = pipeline.start(API, extra_env={**API_ENV, "OCRSTREAM_WEBHOOK_ENABLED": "false",
                                        "OCRSTREAM_HTTP_MAX_WAITERS": str(SMALL_MAX_WAITERS),
                                        "OCRSTREAM_HTTP_EVENTS_KEEPALIVE_S": str(SMALL_KEEPALIVE_S)})
    st.url = f"http://127.0.0.1:{st.port}"
    yield st
    pipeline.stop(st)


def _client(st) -> httpx.Client:
    return httpx.Client(base_url=st.url, timeout=90)


def sse(resp: httpx.Response) -> Iterator[dict]:
    """The events of a ``text/event-stream`` body as ``{"event", "id", "data"}`` dicts (``data``
    parsed as JSON); a comment line as ``{"comment": text}``. Follows the WHATWG parsing rules
    for the fields used here: ``field: value`` lines, one space after the colon dropped, an event
    dispatched at a blank line."""
    ev: dict = {}
    for line in resp.iter_lines():
        if line == "":
            if ev:
                ev["data"] = orjson.loads(ev["data"])
                yield ev
                ev = {}
        elif line.startswith(":"):
            yield {"comment": line[1:].strip()}
        else:
            field, _, value = line.partition(":")
            ev[field] = value[1:] if value.startswith(" ") else value


def _pending_forever() -> str:
    """A request id the door knows as accepted and pending (its Redis marker, as a submission
    leaves it) whose completion never comes: nothing was sent for it."""
    rid = f"never-{uuid.uuid4().hex[:12]}"

    async def mark() -> None:
        cache = ResultCache(CommonSettings().redis)
        try:
            await cache.mark_accepted(rid, orjson.dumps({"key": None, "sha": "0" * 64}), 600)
        finally:
            await cache.close()

    asyncio.run(mark())
    return rid


def _metric(st, name: str) -> float:
    return metric_value(httpx.get(f"{st.url}/metrics", timeout=30).text, name)


def _until(st, name: str, want: float, patience_s: float = 30) -> float:
    """Poll metric ``name`` until it is ``want`` (or patience runs out); returns the last value."""
    deadline = time.monotonic() + patience_s
    while (got := _metric(st, name)) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def test_a_batch_is_watched_on_one_stream_to_its_end(api):
    texts = ["STREAM ONE 3141", "STREAM TWO 2718", "STREAM THREE 1618"]
    with _client(api) as c:
        files = [("files", (f"s{i}.png", text_image([t], size=40), "image/png")) for i, t in enumerate(texts)]
        r = c.post("/v1/ocr/batch", files=files, data={"source": "sse"})
        assert r.status_code == 202, r.text
        body = r.json()
        rids = [it["request_id"] for it in body["items"]]
        assert len(set(rids)) == 3 and all(it["links"]["self"] == f"/v1/ocr/{it['request_id']}" for it in body["items"])
        link = body["links"]["events"]
        assert link == "/v1/events?" + "&".join(f"id={rid}" for rid in rids)

        with c.stream("GET", link) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "text/event-stream"
            assert resp.headers["cache-control"] == "no-store"
            events = [ev for ev in sse(resp) if "comment" not in ev]

    first, rest = events[:3], events[3:]
    # one event per id first, in the order asked: still pending, or already finished
    assert [ev["id"] for ev in first] == rids
    assert {ev["event"] for ev in first} <= {"pending", "completed"}
    for ev in first:
        if ev["event"] == "pending":
            assert ev["data"] == {"request_id": ev["id"], "status": "pending", "cache_hit": False, "result": None,
                                  "error": None, "links": {"self": f"/v1/ocr/{ev['id']}", "wait": f"/v1/ocr/{ev['id']}?wait=60"}}
    completed = [ev for ev in events if ev["event"] == "completed"]
    assert len(completed) == 3
    assert sorted(ev["id"] for ev in completed) == sorted(rids)
    by_id = {ev["id"]: ev["data"] for ev in completed}
    for rid, text in zip(rids, texts):
        assert by_id[rid]["status"] == "ok" and by_id[rid]["request_id"] == rid
        assert by_id[rid]["result"]["text"] == text
        assert by_id[rid]["result"]["source"] == "sse"
    # then a completed event per request still pending, and the end, last
    assert [ev["event"] for ev in rest] == ["completed"] * (len(rest) - 1) + ["end"]
    assert events[-1]["data"]["reason"] == "done"
    assert sorted(events[-1]["data"]["completed"]) == sorted(rids)
    assert events[-1]["data"]["pending"] == [] and events[-1]["data"]["not_found"] == []
    assert len(events) == 3 + (3 - sum(ev["event"] == "completed" for ev in first)) + 1

    # the completed data is exactly what GET /v1/ocr/{id} answers for the finished request
    with _client(api) as c:
        for rid in rids:
            got = c.get(f"/v1/ocr/{rid}").json()
            assert got == by_id[rid]


def test_a_finished_request_is_completed_at_once_and_unknown_ids_get_an_error_event(api):
    with _client(api) as c:
        r = c.post("/v1/ocr", content=text_image(["ALREADY DONE 42"]), headers={"Content-Type": "image/png"})
        rid = r.json()["request_id"]
        done = c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()
        assert done["status"] == "ok"
        with c.stream("GET", "/v1/events", params={"id": [rid, "no-such-id", rid]}) as resp:
            assert resp.status_code == 200
            events = list(sse(resp))
    assert [(ev["event"], ev["id"]) for ev in events[:2]] == [("completed", rid), ("error", "no-such-id")]
    assert events[0]["data"] == done
    assert events[1]["data"] == {"request_id": "no-such-id",
                                 "error": {"code": "not_found", "message": "no request 'no-such-id'"}}
    # the default timeout is 300 s: ending now shows nothing was waited for
    assert events[2] == {"event": "end", "data": {"reason": "done", "completed": [rid], "pending": [],
                                                  "not_found": ["no-such-id"]}}
    assert len(events) == 3

    with _client(api) as c:
        # an EventSource reconnecting (Last-Event-ID) when nothing is pending is told to stop: 204
        again = c.get("/v1/events", params={"id": rid}, headers={"Last-Event-ID": rid})
        assert again.status_code == 204 and again.content == b""


def test_bad_id_lists_get_400_and_all_unknown_ids_404(api):
    with _client(api) as c:
        too_many = c.get("/v1/events", params={"id": [f"id-{i}" for i in range(65)]})
        assert too_many.status_code == 400, too_many.text
        assert too_many.json()["error"] == {
            "code": "invalid_request",
            "message": "65 request ids: a stream watches at most 64 (OCRSTREAM_HTTP_BATCH_MAX_FILES)"}
        # 64 distinct ids are allowed (then 404: none exists); duplicates count once
        for _ in range(5):  # a Redis or MariaDB lookup that fails under load answers 200 (fail open): ask again
            r = c.get("/v1/events", params={"id": [f"id-{i}" for i in range(64)] * 2, "timeout": 1})
            if r.status_code != 200:
                break
        assert r.status_code == 404 and r.json()["error"] == {"code": "not_found",
                                                              "message": "none of the 64 requests exists"}
        r = c.get("/v1/events")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        assert r.json()["error"]["message"].startswith("query.id:")
        r = c.get("/v1/events", params={"id": "bad\nid"})  # no id field could carry it
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = c.get("/v1/events", params={"id": "x", "timeout": "-1"})
        assert r.status_code == 400 and "timeout" in r.json()["error"]["message"]
        r = c.get("/v1/events", params={"id": "nope"})
        assert r.status_code == 404 and r.json()["error"] == {"code": "not_found", "message": "no request 'nope'"}


def test_a_client_that_leaves_releases_its_waiters(api):
    rids = [_pending_forever(), _pending_forever()]
    assert _metric(api, "ocrstream_http_waiters") == 0
    with _client(api) as c:
        with c.stream("GET", "/v1/events", params={"id": rids}) as resp:
            events = sse(resp)
            assert [next(events)["event"], next(events)["event"]] == ["pending", "pending"]
            assert _metric(api, "ocrstream_http_waiters") == 2
            assert _metric(api, "ocrstream_http_event_streams") == 1
    # the connection is closed with the stream still waiting: the door notices and lets go, well
    # before its next keep-alive write (15 s) could have told it
    assert _until(api, "ocrstream_http_waiters", 0, patience_s=10) == 0
    assert _until(api, "ocrstream_http_event_streams", 0, patience_s=10) == 0


def test_timeout_keep_alives_and_the_waiter_bound(small_door):
    rids = [_pending_forever() for _ in range(SMALL_MAX_WAITERS + 1)]
    with _client(small_door) as c:
        # more pending ids than the door may hold waiters for: 503, and nothing is held
        r = c.get("/v1/events", params={"id": rids})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert r.headers["retry-after"] == "1"
        assert _metric(small_door, "ocrstream_http_waiters") == 0

        with c.stream("GET", "/v1/events", params={"id": rids[:SMALL_MAX_WAITERS], "timeout": 2}) as resp:
            events = list(sse(resp))
        assert [ev.get("event") for ev in events[:3]] == ["pending"] * 3
        assert {"comment": "keep-alive"} in events[3:-1]
        assert events[-1] == {"event": "end", "data": {"reason": "timeout", "completed": [],
                                                       "pending": rids[:3], "not_found": []}}
        assert _until(small_door, "ocrstream_http_waiters", 0) == 0

        # a stream and a long-poll share the bound
        with c.stream("GET", "/v1/events", params={"id": rids[:SMALL_MAX_WAITERS], "timeout": 30}) as resp:
            events = sse(resp)
            assert next(events)["event"] == "pending"
            poll = c.get(f"/v1/ocr/{rids[3]}", params={"wait": 1})
            assert poll.status_code == 503 and poll.json()["error"]["code"] == "overloaded"
        assert _until(small_door, "ocrstream_http_waiters", 0) == 0
        # a timeout over the server's longest is refused, naming the bound (it was taken, then capped)
        for timeout, why in [(1e9, "Input should be less than or equal to 300"), ("1e400", "Input should be a finite number")]:
            r = c.get("/v1/events", params={"id": rids[0], "timeout": timeout})
            assert (r.status_code, r.json()) == (400, {"error": {"code": "invalid_request",
                                                                 "message": f"query.timeout: {why} (timeout: 0 to 300)"}})
        with c.stream("GET", "/v1/events", params={"id": rids[0], "timeout": 300}) as resp:  # the bound itself
            assert resp.status_code == 200 and next(sse(resp))["event"] == "pending"


def test_sigterm_ends_an_open_stream_cleanly_without_end(pipeline):
    """A stream waiting on a request when the door gets SIGTERM ends at once with a complete
    body and no ``end`` event (so an ``EventSource`` reconnects elsewhere), instead of holding
    uvicorn's graceful shutdown to its limit and then being cut off mid-body."""
    st = pipeline.start(API, extra_env={**API_ENV, "OCRSTREAM_WEBHOOK_ENABLED": "false",
                                        "OCRSTREAM_HTTP_EVENTS_KEEPALIVE_S": "3600"})
    rid = _pending_forever()
    with httpx.Client(base_url=f"http://127.0.0.1:{st.port}", timeout=90) as c:
        with c.stream("GET", "/v1/events", params={"id": rid, "timeout": 300}) as resp:
            events = sse(resp)
            assert next(events)["event"] == "pending"
            st.proc.send_signal(signal.SIGTERM)
            rest = list(events)  # raises RemoteProtocolError if the body is cut off
    assert rest == []
    pipeline.stop(st)  # uvicorn re-raises the SIGTERM it handled: the exit status is -15
    log = st.log.read_text()
    assert "graceful shutdown exceeded" not in log and "Traceback" not in log


def test_sigterm_answers_a_waiting_long_poll_pending_at_once(pipeline):
    """A ``?wait=60`` long-poll on a request that never completes gets 200 ``pending`` as soon as
    the door is told to stop, instead of holding the graceful shutdown (20 s) to its limit."""
    import threading

    st = pipeline.start(API, extra_env={**API_ENV, "OCRSTREAM_WEBHOOK_ENABLED": "false"})
    st.url = f"http://127.0.0.1:{st.port}"
    rid = _pending_forever()
    answer: dict = {}

    def poll() -> None:
        with _client(st) as c:
            answer["r"] = c.get(f"/v1/ocr/{rid}", params={"wait": 60})

    waiting = threading.Thread(target=poll)
    waiting.start()
    assert _until(st, "ocrstream_http_waiters", 1) == 1
    st.proc.send_signal(signal.SIGTERM)
    waiting.join(90)  # before the fix: cut off at the 20 s graceful limit, no answer
    assert answer["r"].status_code == 200 and answer["r"].json()["status"] == "pending"
    pipeline.stop(st)
    log = st.log.read_text()
    assert "graceful shutdown exceeded" not in log and "Traceback" not in log
