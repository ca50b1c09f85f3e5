"""Step 3 of the runner's loop (:mod:`services.common.runner`): produce every message a batch
caused and wait for every acknowledgement, retrying while the broker is down, and put something
small in place of a message over its topic's ``max.message.bytes``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka.errors import MessageSizeTooLargeError

from services.common.dlq import key_bytes, oversized_stub, record_bytes
from services.common.errors import is_transient
from services.common.kafka import Outgoing, RenewingProducer
from services.common.retry import retry_outages
from services.common.telemetry import Telemetry

log = logging.getLogger("services.common.runner")

Oversize = Callable[[Outgoing, BaseException, Outgoing], list[Outgoing]]
"""``(message, error, DLQ stub) -> what is produced instead`` (:meth:`Handler.oversize`)."""


class BatchProducer:
    """Produces a batch's messages for the runner.

    Args:
        stage: Stage name for logs, metrics and the DLQ stub.
        producer: A started producer (``acks=all``).
        telemetry: Publish spans and the produced-message counter.
        size_limits: Topic -> its ``max.message.bytes``; a message over it is replaced before it
            is sent (a refused batch leaves a gap in the idempotent producer's sequence numbers).
        dlq_topic: Where the stub of a message too large goes (never replaced itself).
        max_attempts: Rounds a non-retriable send error is tried before it is raised.
        oversize: What goes in place of a message too large for its topic.
        delay: Backoff before retry ``n`` (1, 2, ...), s.
        on_retry: Called before each backoff with ``(n, error, delay_s)``.
    """

    def __init__(self, *, stage: str, producer: RenewingProducer, telemetry: Telemetry, size_limits: dict[str, int],
                 dlq_topic: str, max_attempts: int, oversize: Oversize, delay: Callable[[int], float],
                 on_retry: Callable[[int, BaseException, float], None]):
        self.stage = stage
        self.producer = producer
        self.telemetry = telemetry
        self.size_limits = size_limits
        self.dlq_topic = dlq_topic
        self.max_attempts = max_attempts
        self.oversize = oversize
        self.delay = delay
        self.on_retry = on_retry

    async def produce(self, outgoing: list[Outgoing]) -> None:
        """Send every message and wait for all acknowledgements. A round with failed sends is
        retried (its failed messages only) while the broker is down, and up to ``max_attempts``
        rounds for any other error; a message over its topic's limit is replaced
        (:meth:`_oversized`). An error raised by a send call itself is raised at once."""
        if not outgoing:
            return
        pending = list(outgoing)
        failed_rounds = 0
        round_error: BaseException | None = None

        async def send_all() -> None:
            nonlocal pending, failed_rounds, round_error
            while pending:  # the replacements of refused messages go in the next round, at once
                pending, round_error = await self._send_round(pending)
                if round_error is not None:
                    failed_rounds += 1
                    raise round_error

        def retried(exc: Exception) -> bool:
            return exc is round_error and (is_transient(exc) or failed_rounds < self.max_attempts)

        await retry_outages(send_all, outage=retried, delay=self.delay, on_retry=self.on_retry)

    async def _send_round(self, pending: list[Outgoing]) -> tuple[list[Outgoing], BaseException | None]:
        """Send ``pending`` and wait for every answer: what to send next (the failed messages and
        the replacements of refused ones) and the first error (None when there was none)."""
        futures, spans = [], []
        for msg in pending:
            key = key_bytes(msg)
            span, headers = self.telemetry.produce_span(msg.topic, msg.headers)  # traced messages only
            spans.append(span)
            try:
                limit = self.size_limits.get(msg.topic)
                size = record_bytes(msg, key)
                if limit is not None and size > limit and msg.topic != self.dlq_topic:
                    raise MessageSizeTooLargeError(f"{size} bytes with its record overhead; the topic takes {limit}")
                futures.append(await self.producer.send(msg.topic, msg.value, key=key, headers=headers or None))
            except MessageSizeTooLargeError as exc:
                # Never crash-loop on one oversized message: something small takes its place.
                log.error("%s: %d-byte message for %s is over the size limit; sent to the DLQ instead",
                          self.stage, len(msg.value), msg.topic)
                sends = [await self.producer.send(m.topic, m.value, key=key_bytes(m), headers=m.headers or None)
                         for m in self._oversized(msg, exc)]
                futures.append(asyncio.gather(*sends))
        results = await asyncio.gather(*futures, return_exceptions=True)
        for span, res in zip(spans, results):
            self.telemetry.end_produce(span, res)
        failed: list[Outgoing] = []
        first: BaseException | None = None
        for msg, res in zip(pending, results):
            if isinstance(res, MessageSizeTooLargeError) and msg.topic != self.dlq_topic:
                # refused by the broker all the same (a limit lowered since the stage started):
                # the same replacement. The next send to that partition fails on the sequence gap
                # the refused batch left; the producer then renews itself and it is retried.
                log.error("%s: the broker refused a %d-byte message for %s as too large; sent to the DLQ instead",
                          self.stage, len(msg.value), msg.topic)
                failed.extend(self._oversized(msg, res))
            elif isinstance(res, BaseException):
                failed.append(msg)
                first = first or res
            else:
                self.telemetry.message_out(self.stage, msg.topic)
        return failed, first

    def _oversized(self, msg: Outgoing, exc: BaseException) -> list[Outgoing]:
        """What goes in place of ``msg``, too large for its topic: ``oversize`` of the DLQ stub
        (the stub alone if the hook fails)."""
        stub = oversized_stub(self.stage, self.dlq_topic, msg, exc)
        try:
            return self.oversize(msg, exc, stub)
        except Exception as err:  # noqa: BLE001 - a replacement must not fail the batch for good
            log.error("%s: the handler's oversize hook failed (%r); the DLQ stub alone goes", self.stage, err)
            return [stub]
