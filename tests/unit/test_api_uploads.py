"""The HTTP door's upload budget (bytes held in memory at once, across requests) and the cutting
and sending of a large raw body in S3 parts (store and upload passed in)."""

import asyncio

import pytest

from services.api.errors import ApiError
from services.api.uploads import (
    STREAM_SLACK, BodyPace, PartSplitter, StagedBody, UploadBudget, UploadGate, expected_hold,
)


def test_budget_refuses_past_its_limit_and_releases_per_request():
    budget = UploadBudget(100)
    a, b = budget.reservation(), budget.reservation()
    a.take(60)
    b.take(40)
    assert budget.used == 100
    with pytest.raises(ApiError) as err:
        b.take(1)
    assert err.value.status == 503 and err.value.code == "overloaded" and err.value.headers == {"Retry-After": "1"}
    a.release()
    a.release()  # idempotent
    assert budget.used == 40
    b.take(60)
    b.release()
    assert budget.used == 0


def test_zero_means_unbounded():
    r = UploadBudget(0).reservation()
    r.take(10**12)
    assert r.held == 10**12


def test_reservation_gives_back_part_by_part_and_never_below_zero():
    budget = UploadBudget(100)
    r = budget.reservation()
    r.take(70)
    r.give(30)
    assert (budget.used, r.held) == (40, 40)
    r.give(1000)  # at most what is held
    assert (budget.used, r.held) == (0, 0)
    r.release()
    assert budget.used == 0


def test_admission_checks_room_but_a_declared_size_holds_nothing():
    """What a request declares is only checked against the room there is now; the budget is
    charged with the bytes that arrive (32 clients announcing large bodies hold nothing)."""
    budget = UploadBudget(100)
    a, b, c = budget.reservation(), budget.reservation(), budget.reservation()
    for r in (a, b, c):
        r.admit(60)  # each fits the idle budget; nothing is set aside
    assert budget.used == 0
    a.take(60)
    with pytest.raises(ApiError) as err:
        b.admit(50)  # does not fit next to a's 60 bytes in memory: refused before its body is read
    assert err.value.status == 503 and err.value.code == "overloaded"
    b.admit(40)
    b.take(40)
    assert budget.used == 100
    with pytest.raises(ApiError):
        c.take(1)  # past the budget: the chunk's request fails
    assert (c.held, budget.used) == (0, 100)
    a.give(30)  # a part sent to S3
    assert (a.held, budget.used) == (30, 70)
    with pytest.raises(ApiError):
        budget.reservation().admit(10**9)  # more than the budget: checked as the whole budget, which is not idle
    a.release()
    b.release()
    assert budget.used == 0
    UploadBudget(100).reservation().admit(10**9)  # an idle budget never refuses


def _request(content_length: int | None = None, client: str | None = "10.0.0.1"):
    from starlette.requests import Request

    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/ocr", "headers": headers}
    if client is not None:
        scope["client"] = (client, 4242)
    return Request(scope)


def test_gate_limits_uploads_per_client_and_per_key_and_frees_slots_on_release():
    gate = UploadGate(1000, per_client=2, per_key=3)
    a1, a2 = gate.open(_request(500), None, 500), gate.open(_request(500), None, 500)
    with pytest.raises(ApiError) as err:
        gate.open(_request(500), None, 500)
    assert (err.value.status, err.value.code, err.value.headers) == (429, "too_many_uploads", {"Retry-After": "1"})
    assert "client 10.0.0.1 already has 2 uploads" in err.value.message
    other = gate.open(_request(500, "10.0.0.2"), None, 500)  # another address has its own slots
    a1.release()
    a1.release()  # idempotent: frees its slot once
    a3 = gate.open(_request(500), None, 500)
    assert gate.by_client == {"10.0.0.1": 2, "10.0.0.2": 1} and gate.open_uploads == 3
    for r in (a2, a3, other):
        r.release()
    assert gate.by_client == {} and gate.open_uploads == 0
    k = [gate.open(_request(None, f"10.1.0.{i}"), "key1", 0) for i in range(3)]  # chunked: no length
    with pytest.raises(ApiError) as err:
        gate.open(_request(None, "10.1.0.9"), "key1", 0)
    assert err.value.code == "too_many_uploads" and "API key key1 already has 3 uploads" in err.value.message
    gate.open(_request(None, "10.1.0.9"), "key2", 0).release()
    for r in k:
        r.release()
    assert gate.by_key == {} and gate.by_client == {}


def test_small_bodies_have_their_own_budget_and_take_no_slot():
    gate = UploadGate(100, small_limit=50, small_body_bytes=20, per_client=1)
    big = gate.open(_request(1000), None, 100)
    big.take(100)  # the upload budget is full
    with pytest.raises(ApiError) as err:
        gate.open(_request(1000, "10.0.0.2"), None, 100)
    assert err.value.code == "overloaded"
    with pytest.raises(ApiError) as err:
        gate.open(_request(1000), None, 100)
    assert err.value.code == "too_many_uploads"  # 10.0.0.1's one slot is taken
    small = [gate.open(_request(20), None, 20) for _ in range(2)]  # same client: no slot needed
    for r in small:
        assert r.budget is gate.small
        r.take(20)
    assert (gate.small.used, gate.held(), gate.open_uploads) == (40, 140, 3)
    with pytest.raises(ApiError) as err:  # the small budget has no room for 20 more, the upload budget neither
        gate.open(_request(20, "10.0.0.3"), None, 20)
    assert err.value.code == "overloaded"
    for r in [big, *small]:
        r.release()
    assert (gate.held(), gate.open_uploads, gate.by_client) == (0, 0, {})


def test_body_pace_picks_the_earliest_bound_and_leaves_the_doors_time_out():
    pace = BodyPace(total_s=100, idle_s=5, min_rate=1000, grace_s=2)
    # at the start the grace (2 s) comes first
    assert pace.deadline(0.0, 10.0, 0)[0] == pytest.approx(12.0)
    assert "slower than 1000 bytes/s" in pace.deadline(0.0, 10.0, 0)[1]
    # 10 KB in: 2 + 10 s of credit, 3 s of it spent waiting -> 9 s more; the idle bound (5 s) is earlier
    d, why = pace.deadline(3.0, 50.0, 10_000)
    assert d == pytest.approx(55.0) and why == "no byte of the body came for 5 s"
    # 1 MB in: 1002 s of credit, the whole-body bound (100 s of waiting, 98 spent) wins
    d, why = pace.deadline(98.0, 500.0, 1_000_000)
    assert d == pytest.approx(502.0) and why == "the body did not arrive within 100 s"
    assert BodyPace().deadline(0.0, 1.0, 0) == (None, "")


def test_a_trickling_body_is_cut_with_408_by_its_minimum_rate():
    from starlette.requests import Request

    from services.api.uploads import limited_stream

    async def receive():
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}  # 20 bytes/s for ever

    async def main():
        request = Request({"type": "http", "method": "POST", "path": "/v1/ocr", "headers": []}, receive)
        held = UploadBudget(0).reservation()
        got = 0
        with pytest.raises(ApiError) as err:
            async for chunk in limited_stream(request, 10**6, held, BodyPace(idle_s=1, min_rate=100, grace_s=0.3)):
                got += len(chunk)
        return err.value, got

    loop_time = asyncio.new_event_loop()
    try:
        started = loop_time.time()
        err, got = loop_time.run_until_complete(main())
        took = loop_time.time() - started
    finally:
        loop_time.close()
    assert (err.status, err.code) == (408, "request_timeout") and "slower than 100 bytes/s" in err.message
    # cut once 0.3 s + got/100 s of waiting passed: ~0.4 s and ~8 bytes at 20 bytes/s, before the 1 s
    # idle bound (the message says which bound cut it); a loaded machine delivers fewer chunks by then
    assert 0.3 <= took < 3.0 and 1 <= got <= 12, (took, got)


@pytest.mark.parametrize("length, part, want", [
    (None, 0, 0), ("abc", 0, 0), ("-5", 0, 0), ("1001", 0, 0),  # unknown (a batch), malformed, over the limit
    (None, 400, 1000),  # chunked, streamed: the most it can hold (here the limit)
    ("1000", 0, 1000), ("10", 0, 10),  # held whole
    ("399", 400, 399),  # under one part: held whole
    ("400", 400, 400), ("1000", 400, 1000),  # streamed: min(body, two parts + STREAM_SLACK)
])
def test_expected_hold_from_content_length(length, part, want):
    from starlette.requests import Request

    headers = [] if length is None else [(b"content-length", length.encode())]
    request = Request({"type": "http", "method": "POST", "path": "/v1/ocr", "headers": headers})
    assert expected_hold(request, 1000, part) == want


def test_expected_hold_of_a_streamed_body_is_two_parts():
    from starlette.requests import Request

    mib = 1024 * 1024
    request = Request({"type": "http", "method": "POST", "path": "/v1/ocr",
                       "headers": [(b"content-length", str(40 * mib).encode())]})
    assert expected_hold(request, 50 * mib, 8 * mib) == 16 * mib + STREAM_SLACK
    assert expected_hold(request, 50 * mib) == 40 * mib  # not streamed (multipart): all of it
    chunked = Request({"type": "http", "method": "POST", "path": "/v1/ocr", "headers": []})
    assert expected_hold(chunked, 50 * mib, 8 * mib) == 16 * mib + STREAM_SLACK  # whatever its length turns out


@pytest.mark.parametrize("chunk", [1, 3, 7, 10, 64])
def test_part_splitter_cuts_parts_of_at_least_the_size_in_order(chunk):
    data = bytes(range(256)) * 2
    sp = PartSplitter(10)
    parts = []
    for i in range(0, len(data), chunk):
        p = sp.feed(data[i:i + chunk])
        if p is not None:
            parts.append(bytes(p))
    rest = bytes(sp.rest())
    assert b"".join(parts) + rest == data
    assert all(10 <= len(p) < 10 + chunk for p in parts)
    assert len(rest) < 10


def test_part_splitter_of_size_zero_never_cuts():
    sp = PartSplitter(0)
    assert all(sp.feed(b"x" * 1000) is None for _ in range(10))
    assert len(sp.rest()) == 10_000


class FakeUpload:
    """A multipart upload whose parts wait for ``gate``; records what happened, in order."""

    def __init__(self, log: list, gate: asyncio.Event, fail_part: int | None = None):
        self.log, self.gate, self.fail_part = log, gate, fail_part
        self.state, self.parts, self.upload_id = "open", [], "u1"

    async def upload_part(self, data) -> None:
        n = len(self.parts) + 1
        self.parts.append(bytes(data))
        self.log.append(f"start {n}")
        await self.gate.wait()
        if n == self.fail_part:
            self.log.append(f"fail {n}")
            raise OSError("S3 is down")
        self.log.append(f"sent {n}")

    async def abort(self) -> None:
        self.log.append("abort")
        self.state = "aborted"


class FakeStore:
    def __init__(self, upload: FakeUpload):
        self.upload = upload

    def staging_key(self) -> str:
        return "staging/x"

    async def start_multipart(self, key: str) -> FakeUpload:
        self.upload.log.append(f"create {key}")
        return self.upload


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.001)


def test_staged_body_holds_at_most_one_part_in_flight_and_gives_the_budget_back():
    async def main():
        log, gate = [], asyncio.Event()
        budget = UploadBudget(0)
        held = budget.reservation()
        ends = []
        sb = StagedBody(FakeStore(FakeUpload(log, gate)), held, ends.append)
        held.take(30)  # what limited_stream charged for the first three 10-byte parts
        await sb.add(bytearray(b"a" * 10))
        second = asyncio.ensure_future(sb.add(bytearray(b"b" * 10)))
        await _settle()
        assert log == ["create staging/x", "start 1"] and not second.done()  # waits for part 1
        assert held.held == 30
        gate.set()
        await second
        await sb.finish(bytearray(b"c" * 3))
        assert log == ["create staging/x", "start 1", "sent 1", "start 2", "sent 2", "start 3", "sent 3"]
        assert held.held == 30 - 23 and sb.size == 23
        sb.spool.seek(0)
        assert sb.spool.read() == b"a" * 10 + b"b" * 10 + b"c" * 3
        await sb.discard()
        await sb.discard()  # idempotent
        assert log[-1] == "abort" and ends == ["aborted"] and sb.spool.closed

    asyncio.run(main())


def test_a_failed_part_is_a_503_and_discard_aborts_after_the_part_in_flight():
    async def main():
        log, gate = [], asyncio.Event()
        ends = []
        sb = StagedBody(FakeStore(FakeUpload(log, gate, fail_part=1)), None, ends.append)
        await sb.add(bytearray(b"a" * 10))
        gate.set()
        with pytest.raises(ApiError) as err:
            await sb.add(bytearray(b"b" * 10))
        assert err.value.status == 503 and err.value.code == "unavailable" and "S3 is down" in err.value.message
        # a part still in flight when the request ends: the abort comes after it
        log2, gate2 = [], asyncio.Event()
        sb2 = StagedBody(FakeStore(FakeUpload(log2, gate2)), None, ends.append)
        await sb2.add(bytearray(b"a" * 10))
        ending = asyncio.ensure_future(sb2.discard())
        await _settle()
        assert log2 == ["create staging/x", "start 1"] and not ending.done()
        gate2.set()
        await ending
        await sb.discard()
        assert log2 == ["create staging/x", "start 1", "sent 1", "abort"]
        assert log == ["create staging/x", "start 1", "fail 1", "abort"]
        assert ends == ["aborted", "aborted"]

    asyncio.run(main())


def test_a_client_that_leaves_mid_body_is_a_499_not_a_server_error():
    """Starlette's ``ClientDisconnect`` (the ASGI server's ``http.disconnect``) becomes the door's
    own error, so the route counts it and no "Exception in ASGI application" traceback is logged."""
    from starlette.requests import Request

    from services.api.uploads import read_raw

    messages = [{"type": "http.request", "body": b"\x89PNG" + b"x" * 100, "more_body": True},
                {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)

    async def main():
        request = Request({"type": "http", "method": "POST", "path": "/v1/ocr", "headers": []}, receive)
        budget = UploadBudget(0).reservation()
        with pytest.raises(ApiError) as err:
            await read_raw(request, 1000, budget)
        return err.value

    err = asyncio.run(main())
    assert (err.status, err.code) == (499, "client_closed")
