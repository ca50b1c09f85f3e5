"""A process's budget of decoded-pixel bytes (:class:`PixelBudget`) and one holding of it
(:class:`Hold`): the infer stage takes from it before it decodes an image (``docs/images.md``),
so decoded pixels in memory stay bounded however many pages are in flight."""

from __future__ import annotations

import asyncio
import collections


class PixelBudget:
    """Bytes of decoded pixels one process may hold at once, handed out first come, first served,
    except that an *urgent* request (an interactive page's) waits only behind other urgent ones.

    A request for more than the whole budget is granted when nothing else is held (it runs
    alone), so the bound is ``max(limit, the largest single image)``; the largest single image is
    bounded by ``2 x limits.max_pixels x 3`` bytes (:data:`services.common.images.imaging.TOTAL_PIXELS_FACTOR`).

    Args:
        limit: Bytes; 0 = unbounded.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0  # the most bytes held at once since start
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._urgent = 0  # waiters at the front of the queue that asked as urgent

    def _fits(self, n: int) -> bool:
        return not self.limit or self.used == 0 or self.used + n <= self.limit

    def try_acquire(self, n: int, urgent: bool = False) -> bool:
        """Take ``n`` bytes if they fit now and nobody is waiting ahead (for an urgent request:
        no urgent one); True if taken."""
        if (self._urgent if urgent else self._waiters) or not self._fits(n):
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    async def acquire(self, n: int, urgent: bool = False) -> None:
        """Take ``n`` bytes, waiting until they fit: in order of arrival, urgent requests ahead
        of every other."""
        if self.try_acquire(n, urgent):
            return
        fut = asyncio.get_running_loop().create_future()
        if urgent:
            self._waiters.insert(self._urgent, (n, fut))
            self._urgent += 1
        else:
            self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as we were cancelled
            else:
                idx = self._waiters.index((n, fut))
                if idx < self._urgent:
                    self._urgent -= 1
                del self._waiters[idx]
                self._wake()
            raise

    def release(self, n: int) -> None:
        """Give ``n`` bytes back and wake the waiters that now fit, in order."""
        self.used = max(0, self.used - n)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.popleft()
            if self._urgent:
                self._urgent -= 1
            if not fut.done():
                self.used += n
                self.peak = max(self.peak, self.used)
                fut.set_result(None)

    @property
    def waiting(self) -> int:
        """Requests waiting for bytes."""
        return len(self._waiters)


class Hold:
    """Bytes taken from a :class:`PixelBudget`, given back once by :meth:`release` (idempotent)."""

    def __init__(self, budget: PixelBudget, n: int):
        self.budget = budget
        self.n = n
        self._held = True

    def release(self) -> None:
        """Give the bytes back (the first call only)."""
        if self._held:
            self._held = False
            self.budget.release(self.n)
