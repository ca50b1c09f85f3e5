"""The HTTP door's upload budget (bytes held in memory at once, across requests) and the cutting
and sending of a large raw body in S3 parts (store and upload passed in)."""

import asyncio

import pytest

from services.ingest.api.errors import ApiError
from services.ingest.api.uploads import STREAM_SLACK, PartSplitter, StagedBody, UploadBudget, expected_hold


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


def test_admission_refuses_new_uploads_before_cutting_off_admitted_ones():
    budget = UploadBudget(100)
    a, b, c = budget.reservation(), budget.reservation(), budget.reservation()
    a.admit(60)
    with pytest.raises(ApiError) as err:
        b.admit(50)  # does not fit next to a's 60: refused before its body is read
    assert err.value.status == 503 and err.value.code == "overloaded"
    assert (b.held, budget.used) == (0, 60)
    b.admit(40)
    for _ in range(6):
        a.take(10)  # within its reservation: never refused, nothing more charged
    assert (a.held, budget.used) == (60, 100)
    with pytest.raises(ApiError):
        c.admit(1)
    with pytest.raises(ApiError):
        a.take(1)  # past its reservation, and the budget is full
    assert (a.in_memory, a.held) == (60, 60)
    a.give(30)  # a part sent to S3: the reservation stays
    assert (a.held, budget.used) == (60, 100)
    b.release()
    a.take(35)  # 65 in memory: 5 past the reservation, charged now
    assert (a.held, budget.used) == (65, 65)
    a.give(65)
    assert (a.held, budget.used) == (60, 60)
    a.release()
    assert budget.used == 0


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

    from services.ingest.api.uploads import read_raw

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
