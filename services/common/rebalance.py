"""The runner's rebalance listener (:class:`Revocations`); the protocol it follows is described in
:mod:`services.common.runner`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from aiokafka import ConsumerRebalanceListener, TopicPartition

if TYPE_CHECKING:
    from services.common.runner import StageRunner

log = logging.getLogger("services.common.runner")


class Revocations(ConsumerRebalanceListener):
    """The runner's rebalance listener: pass it to ``consumer.subscribe(..., listener=...)``.

    Source: aiokafka 0.12 ``GroupCoordinator._on_join_prepare`` awaits ``on_partitions_revoked``
    before rejoining, from its background task; ``_on_join_complete`` awaits
    ``on_partitions_assigned`` after the new assignment is set, but the fetcher may already return
    records of it meanwhile (seen on Kafka 4.1): the runner takes no batch until the callback has
    returned.
    """

    def __init__(self, runner: "StageRunner"):
        self._runner = runner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """With ``drain_on_revoke``, wait for the batch in flight to be committed first; then drop the
        runner's unhandled records of ``revoked``; bar the batch in flight from committing them;
        clear their in-progress marks (a rebalance is not a death); tell the handler."""
        await self._runner._drain_for_revoke()
        self._runner._revoke(set(revoked))
        await self._runner._unmark(set(revoked))
        try:
            await self._runner.handler.on_revoked(set(revoked))
        except Exception as exc:  # noqa: BLE001 - a failing cleanup must not break the rebalance
            log.warning("%s: the handler's revocation hook failed: %r", self._runner.stage, exc)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Log the new assignment (partitions start at their committed offsets) and count the
        deaths their commit metadata records."""
        log.info("%s: assigned %s", self._runner.stage, sorted(assigned))
        await self._runner._assigned(set(assigned))
