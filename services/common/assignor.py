"""A consumer-group assignor that keeps partition p of every subscribed topic on one member.

Dedup reads ``ocr.requests`` and ``ocr.settled`` in one consumer group and keeps keyed state per
partition (:mod:`services.dedup.state`). Every event is keyed by the image's SHA-256 and both
topics have the same partition count, so a request and the settlement of its cache key land on
the same partition number; this assignor gives that number of both topics to the same member, as
Kafka Streams does for co-partitioned inputs (its ``StreamsPartitionAssignor`` groups the same
partition of every source topic into one task). aiokafka's default, round-robin, deals the
partitions of all topics out in one sequence and splits them.

Partition numbers are laid out in numeric order and members in lexicographic order of their member
ids; each member takes a contiguous range (the first few one extra), like Kafka's
``RangeAssignor`` but over partition numbers instead of per topic, so the result holds even when
members subscribe in a different topic order. A topic with fewer partitions than another simply
has no partition of the higher numbers (``ocrstream init`` creates them equal, and dedup refuses
to start otherwise).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping

from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata

log = logging.getLogger(__name__)


def copartitioned_assignment(members: Mapping[str, Iterable[str]],
                             partitions: Mapping[str, Iterable[int]]) -> dict[str, dict[str, list[int]]]:
    """Assign partition numbers to members; each member gets its numbers of every topic it subscribes.

    Args:
        members: Member id -> the topics it subscribes to.
        partitions: Topic -> its partition numbers (topics without metadata left out).

    Returns:
        Member id -> topic -> sorted partition numbers (every member present, possibly empty).
    """
    numbers = sorted({p for ps in partitions.values() for p in ps})
    order = sorted(members)
    out: dict[str, dict[str, list[int]]] = {m: defaultdict(list) for m in order}
    if not order:
        return {}
    per, extra = divmod(len(numbers), len(order))
    start = 0
    for i, member in enumerate(order):
        n = per + (1 if i < extra else 0)
        mine = numbers[start:start + n]
        start += n
        for topic in members[member]:
            have = set(partitions.get(topic, ()))
            got = [p for p in mine if p in have]
            if got:
                out[member][topic] = got
    return {m: dict(t) for m, t in out.items()}


class CopartitionedAssignor(AbstractPartitionAssignor):
    """aiokafka assignor: ``partition_assignment_strategy=(CopartitionedAssignor,)`` (see the module
    docstring). Every member of a group must use it (the broker picks a protocol all members list)."""

    name = "ocrstream-copartitioned"
    version = 0

    @classmethod
    def assign(cls, cluster: ClusterMetadata,
               members: Mapping[str, ConsumerProtocolMemberMetadata]) -> dict[str, ConsumerProtocolMemberAssignment]:
        """The group leader's assignment for ``members`` (member id -> subscription metadata)."""
        subscribed = {m: list(meta.subscription) for m, meta in members.items()}
        partitions: dict[str, list[int]] = {}
        for topic in {t for ts in subscribed.values() for t in ts}:
            ps = cluster.partitions_for_topic(topic)
            if ps is None:
                log.warning("no partition metadata for topic %s", topic)
                continue
            partitions[topic] = sorted(ps)
        counts = {t: len(ps) for t, ps in partitions.items()}
        if len(set(counts.values())) > 1:
            log.error("co-partitioned topics have different partition counts %s: keys of one partition number may "
                      "not meet", counts)
        plan = copartitioned_assignment(subscribed, partitions)
        return {m: ConsumerProtocolMemberAssignment(cls.version, sorted(plan.get(m, {}).items()), b"")
                for m in members}

    @classmethod
    def metadata(cls, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        """This member's subscription, as sent in its JoinGroup request."""
        return ConsumerProtocolMemberMetadata(cls.version, list(topics), b"")

    @classmethod
    def on_assignment(cls, assignment: ConsumerProtocolMemberAssignment) -> None:
        """Nothing to remember (the assignment depends on the members only)."""
