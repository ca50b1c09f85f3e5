"""The runner's one retry loop (services/common/retry.py, on tenacity): outages retried with
backoff for as long as they last, anything else raised as it was."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import StoreUnavailable
from services.common.retry import capped_backoff_s, retry_outages


class Flaky:
    """Raises each of ``errors`` in turn, then returns ``"done"``."""

    def __init__(self, *errors: BaseException):
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


def test_backoff_doubles_from_its_first_wait_up_to_its_cap():
    assert [capped_backoff_s(n, 10.0) for n in range(1, 8)] == [0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0]
    assert [capped_backoff_s(n, 5.0, first_s=1.0) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    assert capped_backoff_s(10_000, 1e9) == 0.4 * 2**9  # the exponent stops growing


def test_an_outage_is_retried_until_it_ends_and_each_retry_is_reported():
    fn = Flaky(StoreUnavailable("s3 down"), ConnectionResetError("reset"), TimeoutError())
    seen: list[tuple[int, str, float]] = []
    got = asyncio.run(retry_outages(fn, delay=lambda n: n / 1000,
                                    on_retry=lambda n, exc, d: seen.append((n, type(exc).__name__, d))))
    assert got == "done" and fn.calls == 4
    assert seen == [(1, "StoreUnavailable", 0.001), (2, "ConnectionResetError", 0.002), (3, "TimeoutError", 0.003)]


def test_any_other_error_is_raised_at_once_as_it_was():
    bug = ValueError("a bug")
    fn = Flaky(StoreUnavailable("down"), bug)
    with pytest.raises(ValueError) as info:
        asyncio.run(retry_outages(fn, delay=lambda n: 0.0))
    assert info.value is bug and fn.calls == 2


def test_an_async_verdict_decides_and_a_set_stop_ends_the_retries():
    async def outage(exc: Exception) -> bool:
        await asyncio.sleep(0)
        return isinstance(exc, OSError)

    fn = Flaky(OSError("refused"), OSError("refused"))
    assert asyncio.run(retry_outages(fn, delay=lambda n: 0.0, outage=outage)) == "done" and fn.calls == 3

    async def stopped() -> None:
        stop = asyncio.Event()
        stop.set()
        await retry_outages(Flaky(OSError("refused")), delay=lambda n: 0.0, outage=outage, stop=stop)

    with pytest.raises(OSError):
        asyncio.run(stopped())


def test_a_cancellation_is_never_retried():
    fn = Flaky(asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(retry_outages(fn, delay=lambda n: 0.0, outage=lambda exc: True))
    assert fn.calls == 1
