"""Dedup's keyed state transitions (pure logic, :mod:`services.dedup.state`): claim, join, settle
ok, settle retryable, settle input error, replay, restore, rollback, the settled window."""

from __future__ import annotations

import orjson

from schemas.errors import ErrorCode
from schemas.events import RequestEvent, SettledEvent
from schemas.reading import ErrorInfo
from services.dedup.state import PartitionState

KEY = "g1:" + "ab" * 32
URI = "s3://ocrstream/results/ab/g1.json"


def state(**kw) -> PartitionState:
    args = dict(max_waiters=3, settled_window_ms=1000, settled_max_keys=10, max_attempts=3)
    return PartitionState(0, **(args | kw))


def req(rid: str) -> RequestEvent:
    return RequestEvent(request_id=rid, content_sha256="ab" * 32)


def ok(rid: str, at: int = 10_000, **kw) -> SettledEvent:
    return SettledEvent(cache_key=KEY, content_sha256="ab" * 32, request_id=rid, status="ok", result_uri=URI,
                        settled_at_ms=at, **kw)


def failed(rid: str, code: ErrorCode, attempt: int = 1) -> SettledEvent:
    return SettledEvent(cache_key=KEY, content_sha256="ab" * 32, request_id=rid, status="error", attempt=attempt,
                        error=ErrorInfo(code=code, message="boom"))


def in_flight(st: PartitionState, holder: str = "h", waiters=("w1", "w2")) -> None:
    st.lead(KEY, req(holder))
    for i, w in enumerate(waiters):
        assert st.lookup(KEY, w, 0).kind == "joinable"
        st.join(KEY, 100 + i, req(w))
    st.keep()


def test_claim_then_join_then_settle_ok_answers_every_waiter_and_keeps_the_pointer():
    st = state()
    assert st.lookup(KEY, "h", 0).kind == "absent"
    in_flight(st)
    res = st.settle(ok("h"))
    assert [w.request_id for w in res.answered] == ["w1", "w2"] and res.error is None and res.promoted is None
    assert res.settled.result_uri == URI
    assert st.inflight == {} and st.ids == {}
    found = st.lookup(KEY, "later", 10_500)
    assert found.kind == "settled" and found.settled.result_uri == URI


def test_a_replayed_request_is_a_no_op_and_a_full_key_spills():
    st = state(max_waiters=2)
    in_flight(st)
    assert st.lookup(KEY, "h", 0).kind == "replay"
    assert st.lookup(KEY, "w2", 0).kind == "replay"
    assert st.lookup(KEY, "w3", 0).kind == "spill"


def test_copies_past_the_bound_wait_in_the_changelog_and_are_answered_at_settlement():
    """Past ``max_waiters`` a copy is not computed: its ``w|`` record goes to the changelog, memory
    keeps a count, and the settlement reads the spilled copies back (from the changelog and from
    the changes not yet written), answers them with the others and tombstones them."""
    st = state(max_waiters=2)
    in_flight(st)
    for i in range(3, 7):
        assert st.lookup(KEY, f"w{i}", 0).kind == "spill"
        st.spill(KEY, 100 + i, req(f"w{i}"))
    st.keep()
    written = dict(st.writes())  # w3..w6 (and the rest) reach the changelog
    assert {f"w|{KEY}|w{i}".encode() for i in range(1, 7)} <= set(written)
    assert len(st.inflight[KEY].waiters) == 2 and st.inflight[KEY].spilled == 4
    assert "w3" not in st.ids  # memory holds a count, not the copies
    st.spill(KEY, 200, req("w7"))  # not yet written when the key settles
    res = st.settle(ok("h"))
    assert res.spilled == 5 and [w.request_id for w in res.answered] == ["w1", "w2"]
    changelog = {k: v for k, v in written.items() if v is not None}
    back = st.spilled_waiters(KEY, changelog)
    assert [w.request_id for w in back] == ["w3", "w4", "w5", "w6", "w7"]  # in arrival order, none answered twice
    st.keep()
    tomb = dict(st.writes())
    assert all(tomb[f"w|{KEY}|w{i}".encode()] is None for i in range(1, 8)) and st.inflight == {}


def test_a_restore_holds_the_first_waiters_and_counts_the_rest_as_spilled():
    st = state(max_waiters=10)
    in_flight(st, waiters=tuple(f"w{i}" for i in range(1, 6)))
    records = {k: v for k, v in st.writes()}
    again = state(max_waiters=2)
    assert again.restore(records) == (1, 5, 0)
    f = again.inflight[KEY]
    assert [w.request_id for _, w in f.waiters] == ["w1", "w2"] and f.spilled == 3
    res = again.settle(ok("h"))
    assert res.spilled == 3
    assert [w.request_id for w in again.spilled_waiters(KEY, records)] == ["w3", "w4", "w5"]


def test_retryable_error_of_the_holder_promotes_the_first_waiter_bounded_by_attempts():
    st = state()
    in_flight(st)
    res = st.settle(failed("h", ErrorCode.ENGINE_ERROR))
    assert res.promoted.request_id == "w1" and res.attempt == 2 and res.answered == []
    assert st.inflight[KEY].holder.request_id == "w1" and [w.request_id for _, w in st.inflight[KEY].waiters] == ["w2"]
    assert "h" not in st.ids
    # an error of someone who is not the holder changes nothing
    assert st.settle(failed("h", ErrorCode.ENGINE_ERROR)).promoted is None
    res = st.settle(failed("w1", ErrorCode.ENGINE_ERROR, attempt=2))
    assert res.promoted.request_id == "w2" and res.attempt == 3
    st.join(KEY, 200, req("w3"))
    res = st.settle(failed("w2", ErrorCode.ENGINE_ERROR, attempt=3))  # attempts spent: shared
    assert [w.request_id for w in res.answered] == ["w3"] and res.error.code == ErrorCode.ENGINE_ERROR
    assert st.inflight == {}


def test_input_error_of_the_holder_is_shared_by_every_waiter_and_not_kept():
    st = state()
    in_flight(st)
    res = st.settle(failed("h", ErrorCode.CORRUPT_IMAGE))
    assert [w.request_id for w in res.answered] == ["w1", "w2"] and res.error.code == ErrorCode.CORRUPT_IMAGE
    assert st.lookup(KEY, "again", 0).kind == "absent"


def test_an_ok_of_another_generation_answers_the_waiters_but_is_not_kept():
    st = state()
    in_flight(st)
    res = st.settle(ok("h", cacheable=False))
    assert len(res.answered) == 2 and res.settled.result_uri == URI
    assert st.lookup(KEY, "later", 10_000).kind == "absent"


def test_changelog_records_restore_the_same_state():
    st = state()
    in_flight(st, "h", ("w1", "w2"))
    records = dict(st.writes())
    assert sorted(k.split(b"|")[0] for k in records) == [b"f", b"w", b"w"]
    assert list(st.writes()) == []  # taken once
    other = KEY.replace("g1", "g2")
    st.lead(other, req("h2"))
    st.settle(SettledEvent(cache_key=other, content_sha256="ab" * 32, request_id="h2", status="ok", result_uri=URI,
                           settled_at_ms=5))
    st.keep()
    writes = st.writes()
    assert writes[-1][0] == b"f|" + other.encode() and writes[-1][1] is None  # the holder's tombstone last
    records.update(writes)
    records = {k: v for k, v in records.items() if v is not None}
    again = state()
    assert again.restore(records) == (1, 2, 1)
    assert [w.request_id for _, w in again.inflight[KEY].waiters] == ["w1", "w2"]
    assert again.lookup(KEY, "w1", 0).kind == "replay" and again.settled[other].result_uri == URI


def test_waiters_restored_without_their_holder_are_promoted_or_answered():
    st = state()
    in_flight(st)
    records = {k: v for k, v in st.writes() if not k.startswith(b"f|")}
    again = state()
    again.restore(records)
    assert again.unheld() == [KEY]
    assert again.promote_unheld(KEY).request_id == "w1"
    assert again.unheld() == [] and again.inflight[KEY].holder.request_id == "w1"
    third = state()
    third.restore(records | {b"s|" + KEY.encode(): orjson.dumps({"key": KEY, "result_uri": URI, "at_ms": 1})})
    held, spilled = third.answer_unheld(KEY)
    assert [w.request_id for w in held] == ["w1", "w2"] and spilled == 0 and third.inflight == {}


def test_rollback_undoes_a_failed_call():
    st = state()
    in_flight(st, waiters=("w1",))
    st.join(KEY, 300, req("w9"))
    st.settle(ok("h"))
    st.rollback()
    assert [w.request_id for _, w in st.inflight[KEY].waiters] == ["w1"] and "w9" not in st.ids
    assert st.settled == {}
    assert sorted(st.pending) == [f"f|{KEY}".encode(), f"w|{KEY}|w1".encode()]  # the kept call's writes only


def test_settled_window_expires_and_size_bound_evicts_oldest_first():
    st = state(settled_max_keys=2)
    for i, at in enumerate((1, 2, 3)):
        k = f"g{i}:" + "ab" * 32
        st.lead(k, req(f"h{i}"))
        st.settle(SettledEvent(cache_key=k, content_sha256="ab" * 32, request_id=f"h{i}", status="ok",
                               result_uri=URI, settled_at_ms=at))
    assert list(st.settled) == ["g1:" + "ab" * 32, "g2:" + "ab" * 32]
    assert st.expire(1003) == 1 and list(st.settled) == ["g2:" + "ab" * 32]
    assert st.lookup("g2:" + "ab" * 32, "x", 1003).kind == "settled"
    assert st.lookup("g2:" + "ab" * 32, "x", 1004 + 1000).kind == "absent"


def test_missing_object_from_a_hit_drops_the_settled_pointer():
    st = state()
    st.settle(ok("h"))
    assert KEY in st.settled
    st.settle(failed("some-hit", ErrorCode.MISSING_OBJECT))
    assert KEY not in st.settled
