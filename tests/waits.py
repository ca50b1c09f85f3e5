"""Test helpers that wait for something to happen, with a liveness bound (never a speed check)."""

from __future__ import annotations

import asyncio
import threading


async def until(cond, what: str, bound_s: float = 10.0, every_s: float = 0.005) -> None:
    """Wait for ``cond()`` to hold, checking every ``every_s`` seconds.

    Raises:
        AssertionError: naming ``what``, if it does not hold within ``bound_s`` seconds.
    """
    async def poll():
        while not cond():
            await asyncio.sleep(every_s)
    try:
        await asyncio.wait_for(poll(), bound_s)
    except asyncio.TimeoutError:
        raise AssertionError(f"never happened within {bound_s}s: {what}") from None


async def event_set(event: threading.Event, what: str, bound_s: float = 120) -> None:
    """Wait (in a thread) for ``event``, set by another thread (a loopback server's).

    Raises:
        AssertionError: naming ``what``, if it is not set within ``bound_s`` seconds.
    """
    if not await asyncio.to_thread(event.wait, bound_s):
        raise AssertionError(f"timed out waiting for {what}")
