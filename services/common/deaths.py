"""Records in progress when a stage died, counted across restarts in Kafka's offset-commit metadata.

A record that kills its process (out of memory, a native call that never returns, SIGKILL)
would come back after every restart and take the stage down again. The runner therefore marks a
batch *in progress* before handling it and counts one *death* for each record a dead consumer
left marked; a record with ``poison_after_deaths`` deaths is not handled again but sent to
``ocr.dlq`` (:mod:`services.common.runner`). No store of its own: the marks live in the consumer
group's committed offsets, as the ``metadata`` string Kafka keeps with each one (a field of
every OffsetCommit/OffsetFetch version; the broker keeps up to ``offset.metadata.max.bytes``,
default 4096, per partition).

Per partition, the committed offset's metadata is empty, or JSON such as::

    {"ocrstream": 1, "in_progress": [120, 183], "deaths": [[120, 183, 1]]}

* ``in_progress``: the first and last offset of the records being handled now (the runner
  commits the offset the partition is already at, so the position does not move). A consumer
  that is assigned the partition and finds it set counts one more death for each of them: whoever
  wrote it ended without committing past them (a clean stop commits, a rebalance clears it).
* ``deaths``: runs ``[first, last, n]`` of offsets at or past the committed offset that have
  been in progress ``n`` times when a consumer died. Runs past what fits in
  :data:`METADATA_MAX_BYTES` are left out (logged): those records count from 0 again.

Sources: aiokafka 0.12 ``AIOKafkaConsumer.commit`` takes ``{tp: OffsetAndMetadata(offset,
metadata)}``; ``AIOKafkaAdminClient.list_consumer_group_offsets`` returns them
(OffsetFetch). Measured on the local Kafka 4.1 broker: metadata round-trips unchanged, 4096
bytes are accepted and 4097 refused (``OffsetMetadataTooLargeError``); one commit of two
partitions takes ~6 ms with or without 1 KB of metadata (most of it the broker's
``group.coordinator.append.linger.ms``, 5 ms by default on Kafka 4.x; ``bench/commit_marks.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

import orjson
from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from services.common.records import Record

log = logging.getLogger(__name__)

METADATA_MAX_BYTES = 2048
"""Bound on the metadata string the runner commits per partition, bytes (the broker's
``offset.metadata.max.bytes`` defaults to 4096; half of it leaves room for a stricter broker)."""

MAX_RANGE = 10_000
"""Most offsets one ``in_progress`` range may count a death for (a batch holds at most
``max_batch`` records; the bound only guards against a corrupt or foreign value)."""

CommittedOffsetsReader = Callable[[list[TopicPartition]], Awaitable[dict[TopicPartition, OffsetAndMetadata]]]
"""Reads the group's committed offsets with their metadata (an admin client's
``list_consumer_group_offsets`` bound to the group)."""


def encode(in_progress: tuple[int, int] | None, deaths: dict[int, int]) -> str:
    """The metadata string for one partition: ``""`` when there is nothing to say.

    Args:
        in_progress: First and last offset being handled, or None.
        deaths: Offset -> deaths counted so far (offsets at or past the committed one).

    Returns:
        JSON of at most :data:`METADATA_MAX_BYTES` bytes (runs of the highest offsets are left
        out until it fits).
    """
    runs: list[list[int]] = []
    for off in sorted(deaths):
        n = deaths[off]
        if runs and runs[-1][1] == off - 1 and runs[-1][2] == n:
            runs[-1][1] = off
        else:
            runs.append([off, off, n])
    if in_progress is None and not runs:
        return ""
    while True:
        body: dict = {"ocrstream": 1}
        if in_progress is not None:
            body["in_progress"] = list(in_progress)
        if runs:
            body["deaths"] = runs
        text = orjson.dumps(body).decode()
        if len(text) <= METADATA_MAX_BYTES or not runs:
            return text
        dropped = runs.pop()
        log.warning("commit metadata over %d bytes: deaths of offsets %d..%d left out", METADATA_MAX_BYTES,
                    dropped[0], dropped[1])


def decode(metadata: str | None) -> tuple[tuple[int, int] | None, dict[int, int]]:
    """Inverse of :func:`encode`: ``(in_progress, deaths)``. Metadata that is not ours (empty,
    written by another tool, corrupt) reads as nothing in progress and no deaths."""
    if not metadata or not metadata.startswith('{"ocrstream"'):
        return None, {}
    try:
        body = orjson.loads(metadata)
        progress = body.get("in_progress")
        in_progress = (int(progress[0]), int(progress[1])) if progress else None
        deaths: dict[int, int] = {}
        for first, last, n in body.get("deaths", []):
            for off in range(int(first), min(int(last), int(first) + MAX_RANGE - 1) + 1):
                deaths[off] = int(n)
        return in_progress, deaths
    except (ValueError, TypeError, IndexError, AttributeError):
        log.warning("unreadable commit metadata %r: ignored", metadata[:200])
        return None, {}


def _tp(r: Record) -> TopicPartition:
    return TopicPartition(r.topic, r.partition)


class DeathLedger:
    """What one consumer knows of the deaths of its assigned partitions' records.

    The runner (:class:`~services.common.runner.StageRunner`) calls :meth:`load` on each
    assignment, :meth:`mark` before a batch, :meth:`done` for its commit (and :meth:`committed`
    once that succeeded), :meth:`unmark` when partitions are revoked. Pure bookkeeping: the
    runner makes the commits.

    Args:
        stage: Stage name for logs.
        poison_after: Deaths after which a record is not handled again (>= 1).
        read_committed: Reads the group's committed offsets and metadata.
    """

    def __init__(self, stage: str, poison_after: int, read_committed: CommittedOffsetsReader):
        if poison_after < 1:
            raise ValueError("poison_after must be at least 1")
        self.stage = stage
        self.poison_after = poison_after
        self._read = read_committed
        self._deaths: dict[TopicPartition, dict[int, int]] = {}
        self._marked: dict[TopicPartition, tuple[int, int, int]] = {}  # tp -> (committed offset, first, last)

    # -- reading ---------------------------------------------------------------------------
    async def load(self, assigned: Iterable[TopicPartition], attempts: int = 8) -> None:
        """Read the committed metadata of ``assigned`` and count one death for every offset left
        in progress. Forgets every other partition.

        Retries failed reads with backoff (0.2 s doubling, 5 s at most); if every attempt fails
        the partitions start with no deaths known (logged as an error): their next mark then
        replaces what the metadata held.
        """
        tps = sorted(set(assigned))
        self._deaths = {tp: d for tp, d in self._deaths.items() if tp in tps}
        self._marked = {}
        if not tps:
            return
        committed: dict[TopicPartition, OffsetAndMetadata] | None = None
        for attempt in range(attempts):
            try:
                committed = await self._read(tps)
                break
            except Exception as exc:  # noqa: BLE001 - any failure: retry, then go on without
                log.warning("%s: reading the committed offsets of %s failed (%r); retry %d", self.stage, tps, exc,
                            attempt + 1)
                await asyncio.sleep(min(5.0, 0.2 * 2**attempt))
        if committed is None:
            log.error("%s: cannot read the committed offsets of %s: deaths of their records are not known", self.stage,
                      tps)
            committed = {}
        for tp in tps:
            om = committed.get(tp)
            in_progress, deaths = decode(om.metadata if om else None)
            base = om.offset if om and om.offset >= 0 else 0
            deaths = {off: n for off, n in deaths.items() if off >= base}
            if in_progress is not None:
                first, last = in_progress
                last = min(last, first + MAX_RANGE - 1)
                for off in range(max(first, base), last + 1):
                    deaths[off] = deaths.get(off, 0) + 1
                log.warning("%s: %s: offsets %d..%d were in progress when a consumer of this group ended without "
                            "finishing them: deaths now %s", self.stage, tp, first, last, _runs_text(deaths))
            self._deaths[tp] = deaths

    def deaths(self, record: Record) -> int:
        """Deaths counted for ``record`` (0 when it was never in progress at a death)."""
        return self._deaths.get(_tp(record), {}).get(record.offset, 0)

    def any_suspect(self, records: Iterable[Record]) -> bool:
        """True if a record of ``records`` has at least one death: the batch is handled one record at a time."""
        return any(self.deaths(r) for r in records)

    # -- commits ---------------------------------------------------------------------------
    def mark(self, records: list[Record]) -> dict[TopicPartition, OffsetAndMetadata]:
        """What to commit before handling ``records``: per partition, its first offset in the batch
        (where the partition already is) with ``in_progress`` naming the batch's offsets."""
        spans: dict[TopicPartition, list[int]] = {}
        for r in records:
            tp = _tp(r)
            span = spans.setdefault(tp, [r.offset, r.offset])
            span[0], span[1] = min(span[0], r.offset), max(span[1], r.offset)
        out = {}
        for tp, (first, last) in spans.items():
            deaths = self._deaths.setdefault(tp, {})
            self._marked[tp] = (first, first, last)
            out[tp] = OffsetAndMetadata(first, encode((first, last), deaths))
        return out

    def done(self, offsets: dict[TopicPartition, int]) -> dict[TopicPartition, OffsetAndMetadata]:
        """What to commit after a batch: ``offsets`` (the next offset per partition) with only the
        deaths of offsets still ahead. Call :meth:`committed` once the commit succeeded."""
        return {tp: OffsetAndMetadata(off, encode(None, {o: n for o, n in self._deaths.get(tp, {}).items() if o >= off}))
                for tp, off in offsets.items()}

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        """The commit of :meth:`done` succeeded: those partitions hold no mark, deaths behind them are dropped."""
        for tp, off in offsets.items():
            self._marked.pop(tp, None)
            if tp in self._deaths:
                self._deaths[tp] = {o: n for o, n in self._deaths[tp].items() if o >= off}

    def unmark(self, revoked: Iterable[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
        """What to commit for partitions being revoked: a marked one gets its committed offset back
        with its deaths but nothing in progress, so the next owner counts no death (a rebalance is
        not a death). The ledger forgets the revoked partitions (re-read on assignment)."""
        out = {}
        for tp in revoked:
            mark = self._marked.pop(tp, None)
            deaths = self._deaths.pop(tp, {})
            if mark is not None:
                out[tp] = OffsetAndMetadata(mark[0], encode(None, deaths))
        return out

    def snapshot(self) -> dict[TopicPartition, dict[int, int]]:
        """Deaths known per partition (offset -> deaths), for logs and tests."""
        return {tp: dict(d) for tp, d in self._deaths.items() if d}


def _runs_text(deaths: dict[int, int]) -> str:
    return encode(None, deaths) or "none"


def admin_reader(admin, group_id: str) -> CommittedOffsetsReader:
    """A :data:`CommittedOffsetsReader` over a started ``AIOKafkaAdminClient`` (its
    ``list_consumer_group_offsets``, OffsetFetch to the group's coordinator).

    The consumer's own coordinator could answer the same request, but only through aiokafka's
    private ``_coordinator``; the admin client is the public API for it.
    """
    async def read(tps: list[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
        return await asyncio.wait_for(admin.list_consumer_group_offsets(group_id, partitions=tps), 10)

    return read
