"""Engine slots handed out by lane: :class:`PrioritySlots`, the semaphore in front of an engine
whose concurrency is bounded (RapidOCR's worker threads, an OpenAI-compatible server's requests in
flight), so that an interactive page waiting for a slot goes before every bulk page waiting
(docs/delivery.md, "Two lanes")."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from schemas.lanes import PRIORITIES, Priority


class PrioritySlots:
    """``n`` slots; a waiter of the interactive lane is served before any bulk waiter, each lane
    in arrival order. Within a lane it is a plain FIFO semaphore.

    Args:
        n: Slots (>= 1).

    Attributes:
        busy: Slots held now (the ``ocrstream_engine_slots_busy`` gauge).
    """

    def __init__(self, n: int):
        if n < 1:
            raise ValueError("PrioritySlots needs at least one slot")
        self.n = n
        self.busy = 0
        self._waiters: dict[str, collections.deque[asyncio.Future]] = {p: collections.deque() for p in PRIORITIES}

    def waiting(self, lane: Priority | None = None) -> int:
        """Waiters of ``lane`` (or of every lane)."""
        return sum(len(q) for p, q in self._waiters.items() if lane in (None, p))

    def try_acquire(self) -> bool:
        """Take a slot if one is free and nobody waits; True if taken."""
        if self.busy < self.n and not self.waiting():
            self.busy += 1
            return True
        return False

    async def acquire(self, lane: Priority = "bulk") -> None:
        """Take a slot, waiting behind the earlier waiters of ``lane`` and, for a bulk waiter,
        behind every interactive one."""
        if self.try_acquire():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters[lane].append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as we were cancelled: pass it on
            else:
                self._waiters[lane].remove(fut)
            raise

    def release(self) -> None:
        """Give a slot back; the first interactive waiter (else the first bulk one) takes it."""
        for lane in PRIORITIES:
            q = self._waiters[lane]
            while q:
                fut = q.popleft()
                if not fut.done():
                    fut.set_result(None)  # the slot passes on: busy unchanged
                    return
        self.busy = max(0, self.busy - 1)

    @contextlib.asynccontextmanager
    async def hold(self, lane: Priority = "bulk") -> AsyncIterator[None]:
        """``async with slots.hold(lane):`` one slot for the block."""
        await self.acquire(lane)
        try:
            yield
        finally:
            self.release()
