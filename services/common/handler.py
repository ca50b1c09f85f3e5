"""The interface of a stage's logic, as the runner (:mod:`services.common.runner`) drives it."""

from __future__ import annotations

from abc import ABC, abstractmethod

from aiokafka import ConsumerRecord, TopicPartition

from services.common.kafka import Outgoing


class Handler(ABC):
    """A stage's logic: records in, messages to produce out. Clients are passed to its constructor."""

    @abstractmethod
    async def handle(self, records: list[ConsumerRecord]) -> list[Outgoing]:
        """Process a batch (in offset order per partition) and return every message it causes.

        Called by the runner with 1..max_batch records. Must be idempotent: a batch may be
        redelivered after a crash. Raise to fail the batch (see the module docstring).
        """

    @abstractmethod
    def poison(self, record: ConsumerRecord, exc: BaseException, attempts: int) -> list[Outgoing]:
        """Messages to produce for a record that failed ``attempts`` times with a permanent error.

        Called once per poison record; returns the ``ocr.dlq`` event and, where the record
        names a request, an error result so the request still ends in a final state.
        """

    async def on_idle(self) -> list[Outgoing]:
        """Called about once a second when no records arrive (housekeeping). Default: nothing."""
        return []

    def prefetch(self, records: list[ConsumerRecord]) -> None:
        """Called with records of the *next* batch while the current one runs; may start their
        I/O (e.g. S3 gets). They are passed to :meth:`handle` later as usual. Default: nothing."""

    def forget(self, records: list[ConsumerRecord]) -> None:
        """Drop what :meth:`prefetch` started for ``records``: their partitions were revoked and
        they will never be passed to :meth:`handle` (a new owner fetches them again). Called from
        the rebalance callback, only with records not yet handed to :meth:`handle`. Default: nothing."""

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """Called from the rebalance callback with the partitions just assigned, before any record of
        them is handed to :meth:`handle` (a stage with state restores it here). Default: nothing."""

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Called from the rebalance callback with the partitions being revoked, after the batch in
        flight was committed when the runner drains on revocation (``drain_on_revoke``): drop their
        state. Default: nothing."""

    async def dependencies_ok(self) -> bool | None:
        """Whether every store this handler writes to answers now (a fresh ping of each), asked
        after a batch failed with a retriable-looking error. True: the failure is the batch's own
        and counts as an attempt (after ``max_attempts`` the record goes to the DLQ); False: an
        outage, retried with backoff for as long as it lasts. Default None: cannot tell, an outage."""
        return None

    async def after_produce(self) -> None:
        """Called once the messages of the last ``handle`` (or of ``on_idle``, when it returned any)
        are acknowledged, before the commit. A handler may call it itself after an ``on_idle``
        pass that has nothing to produce."""

    async def close(self) -> None:
        """Release the handler's clients (called once at shutdown)."""
