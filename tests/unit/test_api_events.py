"""The door's server-sent events without the stack: framing, the event sequence over a real
:class:`CompletionHub` (never started; completions resolved by hand) and a client that leaves."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from schemas.events import CompletedEvent, ResultDocument
from services.common.settings import CommonSettings
from services.api.sse import KEEPALIVE, EventStream, Watch, encode, progress
from services.api.hub import CompletionHub


def doc(rid: str, text: str = "HELLO", key: str | None = None) -> ResultDocument:
    return ResultDocument(request_id=rid, status="ok", text=text, api_key_id=key)


def test_encode_follows_the_event_stream_format():
    assert encode("completed", {"a": "x\ny"}, "r-1") == b'event: completed\nid: r-1\ndata: {"a":"x\\ny"}\n\n'
    assert encode("end", b'{"reason":"done"}') == b'event: end\ndata: {"reason":"done"}\n\n'
    with pytest.raises(ValueError, match="does not match"):
        encode("completed", {}, "bad\nid")
    with pytest.raises(ValueError, match="does not match"):
        encode("completed", {}, "trailing-newline\n")  # Python's $ matches before a final newline
    with pytest.raises(ValueError, match="one line"):
        encode("completed", b'{\n}')


def _parse(chunks: list[bytes]) -> list[tuple[str, str | None, dict] | str]:
    out: list = []
    for block in b"".join(chunks).decode().split("\n\n")[:-1]:
        if block.startswith(":"):
            out.append(block)
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((fields["event"], fields.get("id"), orjson.loads(fields["data"])))
    return out


async def _sequence(hub: CompletionHub, snapshot, timeout_s: float, keepalive_s: float = 30,
                    owner: str | None = None, resolve: dict[str, ResultDocument] | None = None) -> list:
    watch = Watch(hub, hub.register_many([rid for rid, _ in snapshot]))
    events = progress(watch, snapshot, completed=lambda d: d.model_dump_json().encode(),
                      pending=lambda rid: orjson.dumps({"request_id": rid, "status": "pending"}),
                      owned=lambda d: owner is None or d.api_key_id == owner, timeout_s=timeout_s,
                      keepalive_s=keepalive_s)
    chunks = [await events.__anext__() for _ in snapshot]  # the first event per id
    for rid, d in (resolve or {}).items():
        for fut in list(hub._waiters.get(rid, ())):
            fut.set_result(CompletedEvent(event_id=f"e-{rid}", request_id=rid, result=d))
    chunks += [c async for c in events]
    return _parse(chunks)


@pytest.fixture
async def hub():
    h = CompletionHub(CommonSettings(), max_waiters=5)
    yield h
    await h.watcher.consumer.stop()  # never started: closes nothing but its client object


async def test_snapshot_then_completions_then_end_and_every_waiter_released(hub):
    done, mine, theirs = doc("a", "DONE"), doc("b", "LATER", key="k1"), doc("d", "NOT YOURS", key="k2")
    got = await _sequence(hub, [("a", done), ("b", True), ("c", None), ("d", True)], timeout_s=30, owner="k1",
                          resolve={"b": mine, "d": theirs})
    assert [(e[0], e[1]) for e in got] == [("completed", "a"), ("pending", "b"), ("error", "c"), ("pending", "d"),
                                          ("completed", "b"), ("error", "d"), ("end", None)]
    assert got[0][2]["text"] == "DONE" and got[4][2]["text"] == "LATER"
    assert got[2][2] == {"request_id": "c", "error": {"code": "not_found", "message": "no request 'c'"}}
    assert got[-1][2] == {"reason": "done", "completed": ["a", "b"], "pending": [], "not_found": ["c", "d"]}
    assert hub.waiting == 0


async def test_timeout_ends_with_the_pending_ids_after_keep_alives(hub):
    got = await _sequence(hub, [("x", True), ("y", True)], timeout_s=0.35, keepalive_s=0.1,
                          resolve={"y": doc("y")})
    assert [e[0] for e in got[:3]] == ["pending", "pending", "completed"]
    assert got[3:-1] and all(e == KEEPALIVE.decode().strip() for e in got[3:-1])
    assert got[-1] == ("end", None, {"reason": "timeout", "completed": ["y"], "pending": ["x"], "not_found": []})
    assert hub.waiting == 0


async def test_the_door_closing_ends_the_stream_without_end_and_releases_the_waiters(hub):
    closing = asyncio.Event()
    snapshot = [("x", True)]
    watch = Watch(hub, hub.register_many(["x"]))
    events = progress(watch, snapshot, completed=lambda d: b"{}", pending=lambda rid: b"{}", owned=lambda d: True,
                      timeout_s=300, keepalive_s=300, closing=closing)
    assert (await events.__anext__()).startswith(b"event: pending")
    asyncio.get_running_loop().call_later(0.05, closing.set)
    assert [c async for c in events] == []  # no "end": an EventSource reconnects to another replica
    assert hub.waiting == 0


async def test_register_many_is_all_or_nothing(hub):
    hub.register("held")
    with pytest.raises(OverflowError, match="limit of 5"):
        hub.register_many(["a", "b", "c", "d", "e"])
    assert hub.waiting == 1
    assert set(hub.register_many(["a", "b", "c", "d"])) == {"a", "b", "c", "d"} and hub.waiting == 5


async def test_a_client_that_leaves_mid_wait_releases_the_waiters(hub):
    watch = Watch(hub, hub.register_many(["p", "q"]))
    closed = []
    events = progress(watch, [("p", True), ("q", True)], completed=lambda d: b"{}", pending=lambda r: b"{}",
                      owned=lambda d: True, timeout_s=60, keepalive_s=60)
    stream = EventStream(events, lambda: closed.append(watch.close()))
    inbox: asyncio.Queue = asyncio.Queue()
    await inbox.put({"type": "http.request", "body": b"", "more_body": False})
    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    task = asyncio.ensure_future(stream(None, inbox.get, send))
    while len(sent) < 3:  # headers and the two pending events
        await asyncio.sleep(0.01)
    assert hub.waiting == 2 and sent[0]["status"] == 200
    assert dict(sent[0]["headers"])[b"content-type"] == b"text/event-stream"
    await inbox.put({"type": "http.disconnect"})
    await asyncio.wait_for(task, 5)
    assert hub.waiting == 0 and len(closed) == 1
    assert sent[-1]["more_body"] is True  # cut off: no end event, no final chunk
