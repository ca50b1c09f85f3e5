"""Long-poll and event-stream waiters, woken by completions read from ``ocr.completed`` (never by polling the DB)."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from schemas.events import CompletedEvent
from services.common.results.completions import CompletionWatcher
from services.common.codec import loads
from services.common.settings import CommonSettings

log = logging.getLogger(__name__)


class CompletionHub:
    """Reads every partition of ``ocr.completed`` from its end (no consumer group, so every API
    replica sees every completion) and resolves the futures of requests being waited on.

    Only records whose key (the request id) has a waiter are parsed, so an idle hub costs one
    fetch loop, not a JSON parse per completion.

    Args:
        settings: Kafka connection and topic names.
        max_waiters: Waiters held at once; :meth:`register` raises ``OverflowError`` past it.
    """

    def __init__(self, settings: CommonSettings, max_waiters: int):
        self.watcher = CompletionWatcher(settings, client_id="ocrstream-api")
        self.max_waiters = max_waiters
        self._waiters: dict[str, set[asyncio.Future]] = defaultdict(set)
        self._count = 0
        self._task: asyncio.Task | None = None
        self.started = asyncio.Event()

    async def start(self) -> None:
        """Connect and seek to the end of every partition, then read in the background."""
        await self.watcher.start()
        self._task = asyncio.create_task(self._run(), name="completion-hub")
        self.started.set()

    async def stop(self) -> None:
        """Stop reading; pending waiters are cancelled."""
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for futs in self._waiters.values():
            for f in futs:
                f.cancel()
        self._waiters.clear()
        await self.watcher.stop()

    def register(self, request_id: str) -> asyncio.Future:
        """A future resolved with the request's :class:`CompletedEvent`. Register *before*
        checking the DB, so a completion landing in between is not missed.

        Raises:
            OverflowError: ``max_waiters`` are already waiting.
        """
        if self._count >= self.max_waiters:
            raise OverflowError(f"{self._count} long-polls are already waiting")
        fut = asyncio.get_running_loop().create_future()
        self._waiters[request_id].add(fut)
        self._count += 1
        return fut

    def register_many(self, request_ids: list[str]) -> dict[str, asyncio.Future]:
        """One future per id (as :meth:`register`), all or none: an event stream holds one
        waiter per request it watches, counted against the same ``max_waiters`` as long-polls.

        Raises:
            OverflowError: the ids do not all fit under ``max_waiters``; none is registered then.
        """
        if self._count + len(request_ids) > self.max_waiters:
            raise OverflowError(f"{self._count} waiters are already held (long-polls and event streams); "
                                f"{len(request_ids)} more would pass the limit of {self.max_waiters}")
        return {rid: self.register(rid) for rid in request_ids}

    def unregister(self, request_id: str, fut: asyncio.Future) -> None:
        """Forget a waiter (after it was resolved or timed out)."""
        futs = self._waiters.get(request_id)
        if futs and fut in futs:
            futs.discard(fut)
            self._count -= 1
            if not futs:
                del self._waiters[request_id]

    @property
    def waiting(self) -> int:
        """Waiters held now: one per long-poll, one per request watched by an event stream."""
        return self._count

    async def _run(self) -> None:
        consumer = self.watcher.consumer
        while True:
            try:
                batch = await consumer.getmany(timeout_ms=1000)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep reading; Kafka errors are transient here
                log.warning("api: reading %s failed (%r); retrying", self.watcher.s.topics.completed, exc)
                await asyncio.sleep(1.0)
                continue
            for recs in batch.values():
                for rec in recs:
                    rid = rec.key.decode() if rec.key else None
                    futs = self._waiters.get(rid) if rid else None
                    if not futs:
                        continue
                    try:
                        ev = loads(CompletedEvent, rec.value)
                    except ValueError as exc:
                        log.warning("api: unreadable completion for %s: %s", rid, exc)
                        continue
                    for f in futs:
                        if not f.done():
                            f.set_result(ev)
