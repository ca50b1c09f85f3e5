"""The interface of a stage's logic, as the runner (:mod:`services.common.runner`) drives it.

A handler declares what it consumes (:meth:`Handler.consumes`: topic -> event model) and is handed
:class:`~services.common.records.Record` values, decoded by the runner, each with the consumer span
the runner opened for it; it returns the :class:`~services.common.kafka.Outgoing` messages they
cause. It never sees aiokafka: the runner fetches, produces, commits and handles rebalances.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping

from aiokafka import TopicPartition  # re-exported: the partitions on_assigned and on_revoked are given
from pydantic import BaseModel


from services.common.kafka import Outgoing
from services.common.records import Record

__all__ = ["Handler", "Outgoing", "Record", "TopicPartition", "poison_of"]


class Handler(ABC):
    """A stage's logic: records in, messages to produce out. Clients are passed to its constructor."""

    def consumes(self) -> Mapping[str, type[BaseModel]]:
        """Topic -> the event model its records' values are parsed into (``Record.value``), asked
        once when the runner is built. A record of a topic not named here is handed over with its
        bytes as ``value``. Default: none (every value as bytes)."""
        return {}

    @abstractmethod
    async def handle(self, records: list[Record]) -> list[Outgoing]:
        """Process a batch (in offset order per partition) and return every message it causes.

        Called by the runner with 1..max_batch records whose values decoded. Must be idempotent: a
        batch may be redelivered after a crash. Raise to fail the batch (see the runner's module
        docstring). Each record's consumer span is ``Record.traced`` (the block of its own work)
        and ``Record.trace_headers`` (for the messages it causes); the runner ends the spans the
        handler left open when the call returns.
        """

    async def undecodable(self, record: Record, exc: Exception) -> list[Outgoing]:
        """Messages for a record whose value did not parse into its topic's model (``record.value``
        is None, ``record.error`` is ``exc``), asked inside the record's span before the rest of its
        batch goes to :meth:`handle`. Default: raise ``exc``, so the record fails as if
        :meth:`handle` had raised on it (tried alone ``max_attempts`` times, then :meth:`poison`
        with ``internal_error``). A handler that refuses such a record at once returns its DLQ
        event and error result here."""
        raise exc

    @abstractmethod
    def poison(self, record: Record, exc: BaseException, attempts: int) -> list[Outgoing]:
        """Messages to produce for a record that failed ``attempts`` times with a permanent error.

        Called once per poison record (its ``value`` may be None: it did not decode); returns the
        ``ocr.dlq`` event and, where the record names a request, an error result so the request
        still ends in a final state. A handler that must read something to end what the record
        held (dedup reads spilled copies back from its changelog) may define it ``async def``;
        the runners call it through :func:`poison_of`.
        """

    def oversize(self, msg: Outgoing, exc: BaseException, stub: Outgoing) -> list[Outgoing]:
        """What is produced in place of ``msg``, a message over its topic's ``max.message.bytes``
        (``exc`` says by how much). ``stub`` is the small ``ocr.dlq`` event naming its request
        that the runner made (:func:`services.common.dlq.oversized_stub`). Default: ``[stub]``. A
        handler whose messages end requests adds what ends them (infer, dedup: an ``ok`` result
        becomes the same result as an ``input_too_large`` error, :func:`~services.common.dlq.oversized_result`)."""
        return [stub]

    async def on_idle(self) -> list[Outgoing]:
        """Called about once a second when no records arrive (housekeeping). Default: nothing."""
        return []

    def prefetch(self, records: list[Record]) -> None:
        """Called with the decoded records of the *next* batch while the current one runs; may start
        their I/O (e.g. S3 gets). They are passed to :meth:`handle` later as usual (without a span
        here: it is opened when they are handled). Default: nothing."""

    def forget(self, records: list[Record]) -> None:
        """Drop what :meth:`prefetch` started for ``records``: their partitions were revoked and
        they will never be passed to :meth:`handle` (a new owner fetches them again). Called from
        the rebalance callback, only with records not yet handed to :meth:`handle`. Default: nothing."""

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """Called from the rebalance callback with the partitions just assigned (``topic`` and
        ``partition`` each), before any record of them is handed to :meth:`handle` (a stage with
        state restores it here). Default: nothing."""

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


async def poison_of(handler: "Handler", record: Record, exc: BaseException, attempts: int) -> list[Outgoing]:
    """``handler.poison(record, exc, attempts)``, awaited when the handler defines it ``async``."""
    out = handler.poison(record, exc, attempts)
    return await out if inspect.isawaitable(out) else out
