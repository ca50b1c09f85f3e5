"""Which keyed uploads the door reads before taking their rate limit (pure logic of the guard)."""

from __future__ import annotations

from services.api.serving_keys import READ_FIRST_PER_KEY, Guard, Limit
from services.api.errors import ApiError
from services.api.ratelimit import Decision
from services.api.settings import ApiSettings

LIMIT = Limit(key_id="k1", rate_per_s=1.0, burst=5, quota_per_day=0, quota=0)
OTHER = Limit(key_id="k2", rate_per_s=1.0, burst=5, quota_per_day=0, quota=0)


def test_at_most_read_first_per_key_requests_of_one_key_are_read_before_their_limit():
    guard = Guard(ApiSettings())
    assert [guard.read_first(LIMIT) for _ in range(READ_FIRST_PER_KEY + 2)] == [True] * READ_FIRST_PER_KEY + [False] * 2
    assert guard.read_first(OTHER) is True  # per key
    guard.done_reading(LIMIT)
    assert guard.read_first(LIMIT) is True and guard.read_first(LIMIT) is False
    for _ in range(READ_FIRST_PER_KEY):
        guard.done_reading(LIMIT)
    assert guard._reading == {"k2": 1}


def test_a_refused_key_is_limited_first_until_its_retry_after(monkeypatch):
    guard = Guard(ApiSettings())
    clock = [1000.0]
    monkeypatch.setattr("services.api.serving_keys.time.monotonic", lambda: clock[0])
    try:
        guard.enforce(LIMIT, Decision(False, "rate_limited", retry_after_s=3))
        raise AssertionError("a refusal must raise")
    except ApiError as err:
        assert err.status == 429 and err.headers["Retry-After"] == "3"
    assert guard.read_first(LIMIT) is False and guard.read_first(OTHER) is True
    clock[0] += 2.9
    assert guard.read_first(LIMIT) is False
    clock[0] += 0.2
    assert guard.read_first(LIMIT) is True
    guard.enforce(LIMIT, Decision(True, "ok"))  # allowed: nothing remembered
    assert "k1" not in guard._refused_until
