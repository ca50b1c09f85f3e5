"""Retrying while something a stage depends on is down: the one retry loop of the runner and of
the stage start-up (:mod:`services.common.runner`, :mod:`services.common.app`), on tenacity."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState

from services.common.errors import is_transient

T = TypeVar("T")


def capped_backoff_s(attempt: int, cap_s: float, first_s: float = 0.4) -> float:
    """Seconds to wait before retry ``attempt`` (1, 2, ...): ``first_s`` doubling per attempt,
    at most ``cap_s`` (the exponent stops growing at 10)."""
    return min(cap_s, first_s * 2 ** (min(attempt, 10) - 1))


async def retry_outages(
    fn: Callable[[], Awaitable[T]],
    *,
    delay: Callable[[int], float],
    outage: Callable[[Exception], bool | Awaitable[bool]] = is_transient,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
    stop: asyncio.Event | None = None,
) -> T:
    """Await ``fn()`` until it returns, and return what it returned.

    A failure that ``outage`` calls an outage (default :func:`~services.common.errors.is_transient`:
    a store or the broker down; it may be a coroutine function) is retried after ``delay(n)``
    seconds, ``n`` = 1, 2, ... the failures so far, with ``on_retry(n, exc, delay_s)`` called before
    each wait; so an outage is retried for as long as it lasts.

    Raises:
        Exception: any other failure of ``fn``, as it was raised; any failure once ``stop`` is set.
        BaseException: a ``BaseException`` that is not an ``Exception`` (cancellation) at once.
    """

    async def retry(state: RetryCallState) -> bool:
        exc = state.outcome.exception() if state.outcome is not None else None
        if not isinstance(exc, Exception) or (stop is not None and stop.is_set()):
            return False
        verdict = outage(exc)
        return bool(await verdict if inspect.isawaitable(verdict) else verdict)

    def wait(state: RetryCallState) -> float:
        return delay(state.attempt_number)

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            on_retry(state.attempt_number, state.outcome.exception(), state.upcoming_sleep)

    async def attempt() -> T:  # tenacity awaits only coroutine functions; ``fn`` may be a lambda
        return await fn()

    return await AsyncRetrying(retry=retry, wait=wait, before_sleep=before_sleep, reraise=True)(attempt)
