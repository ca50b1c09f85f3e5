"""Where one partition's records stand in a window of records finishing out of order
(:class:`PartitionProgress`), and the commit metadata that carries it across processes.

The window runner (:mod:`services.infer.window`) works on many records of a partition at once
and each finishes when its own work does, in any order. The offset it commits is the partition's
*low watermark*: the first record not finished (its output produced and acknowledged), so every
record below it is done and a crash redoes only what is at or above it. With that offset the
runner commits, in the offset's ``metadata`` string (kept by Kafka with each committed offset, no
store of its own; :mod:`services.common.deaths` has the sources), what it knows above the
watermark, relative to it::

    {"ocrstream": 2, "running": [[0, 3], [7, 7]], "done": [[4, 6]], "deaths": [[0, 0, 1]]}

* ``running``: records being handled now. A process that is assigned the partition and finds
  them counts one *death* for each (whoever wrote it ended without finishing them; a clean stop
  and a rebalance commit it empty).
* ``done``: records above the watermark already finished: the next owner skips them instead of
  reading them again (Confluent's Parallel Consumer keeps the same in its commit metadata).
* ``deaths``: runs ``[first, last, n]`` of records in progress at ``n`` deaths so far.

The string is bounded at :data:`~services.common.deaths.METADATA_MAX_BYTES`: past it ``done``
runs are left out from the highest (those records are read again), then ``running`` becomes one
span (records in it that were done count a death too), then ``deaths`` runs are left out from
the highest; each is logged. Metadata of the batch runner (version 1: ``in_progress`` as one
absolute span, absolute ``deaths``) is read too.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

import orjson
from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from services.common.deaths import MAX_RANGE, METADATA_MAX_BYTES
from services.common.deaths import decode as decode_v1

log = logging.getLogger(__name__)


def runs(offsets: Iterable[int]) -> list[list[int]]:
    """``offsets`` as sorted runs of consecutive values ``[first, last]``."""
    out: list[list[int]] = []
    for o in sorted(set(offsets)):
        if out and out[-1][1] == o - 1:
            out[-1][1] = o
        else:
            out.append([o, o])
    return out


def _expand(pairs, base: int) -> set[int]:
    """Offsets of ``[first, last]`` runs relative to ``base`` (each run at most ``MAX_RANGE``)."""
    out: set[int] = set()
    for first, last in pairs:
        first, last = int(first), int(last)
        out.update(range(base + first, base + min(last, first + MAX_RANGE - 1) + 1))
    return out


@dataclass
class Committed:
    """What a partition's last commit said (:func:`read_metadata`).

    Attributes:
        offset: The committed offset (-1: none yet).
        running: Offsets that were being handled when it was written.
        done: Offsets above ``offset`` already finished.
        deaths: Offset -> deaths counted before that commit.
    """

    offset: int = -1
    running: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    deaths: dict[int, int] = field(default_factory=dict)


def read_metadata(offset: int, metadata: str | None) -> Committed:
    """A partition's committed ``offset`` and its ``metadata`` string, read. Version 1 (the batch
    runner's ``in_progress`` span) and version 2 (this module's) are understood; anything else
    (empty, another tool's, corrupt) reads as nothing running, done or dead."""
    out = Committed(offset=offset)
    if not metadata or not metadata.startswith('{"ocrstream"'):
        return out
    try:
        body = orjson.loads(metadata)
        if body.get("ocrstream") != 2:
            in_progress, deaths = decode_v1(metadata)
            if in_progress is not None:
                out.running = _expand([(0, in_progress[1] - in_progress[0])], in_progress[0])
            out.deaths = deaths
            return out
        base = max(offset, 0)
        out.running = _expand(body.get("running", []), base)
        out.done = _expand(body.get("done", []), base)
        for first, last, n in body.get("deaths", []):
            for o in _expand([(first, last)], base):
                out.deaths[o] = int(n)
        return out
    except (ValueError, TypeError, IndexError, AttributeError):
        log.warning("unreadable commit metadata %r: ignored", metadata[:200])
        return Committed(offset=offset)


def write_metadata(base: int, running: set[int], done: set[int], deaths: dict[int, int]) -> str:
    """The metadata string committed with offset ``base`` (module docstring), at most
    :data:`METADATA_MAX_BYTES` bytes; ``""`` when there is nothing to say."""
    rel_running = runs(o - base for o in running)
    rel_done = runs(o - base for o in done)
    rel_deaths: list[list[int]] = []
    for o in sorted(deaths):
        n = deaths[o]
        if rel_deaths and rel_deaths[-1][1] == o - base - 1 and rel_deaths[-1][2] == n:
            rel_deaths[-1][1] = o - base
        else:
            rel_deaths.append([o - base, o - base, n])
    while True:
        body: dict = {"ocrstream": 2}
        for name, value in (("running", rel_running), ("done", rel_done), ("deaths", rel_deaths)):
            if value:
                body[name] = value
        if len(body) == 1:
            return ""
        text = orjson.dumps(body).decode()
        if len(text) <= METADATA_MAX_BYTES:
            return text
        if rel_done:
            first, last = rel_done.pop()
            log.warning("commit metadata over %d bytes: done offsets %d..%d left out (read again after a restart)",
                        METADATA_MAX_BYTES, base + first, base + last)
        elif len(rel_running) > 1:
            rel_running = [[rel_running[0][0], rel_running[-1][1]]]
            log.warning("commit metadata over %d bytes: running offsets kept as one span %s", METADATA_MAX_BYTES,
                        rel_running[0])
        elif rel_deaths:
            first, last, _ = rel_deaths.pop()
            log.warning("commit metadata over %d bytes: deaths of offsets %d..%d left out", METADATA_MAX_BYTES,
                        base + first, base + last)
        else:
            return text  # one running span: always small


class Fate(Enum):
    """What the window does with a record just fetched (:meth:`PartitionProgress.fetched`)."""

    READ = "read"  # handle it
    SUSPECT = "suspect"  # in progress at a death: handle it alone
    POISON = "poison"  # in progress at ``poison_after`` deaths: to the DLQ unhandled
    SKIP = "skip"  # already done (the last commit said so): finish it at once


class PartitionProgress:
    """One partition's records in the window of one assignment: fetched, running, done, and the
    watermark below which every record is done.

    Pure bookkeeping: the window runner fetches, handles, produces and commits.

    Args:
        tp: The partition.
        committed: What its last commit said (:func:`read_metadata`); None when unknown (the
            window then starts counting at the first offset it fetches).
        poison_after: Deaths after which a record goes to the DLQ unhandled; 0 = deaths are
            neither counted nor acted on.
    """

    def __init__(self, tp: TopicPartition, committed: Committed | None = None, poison_after: int = 0):
        self.tp = tp
        c = committed or Committed()
        self.base: int | None = c.offset if c.offset >= 0 else None
        self.poison_after = poison_after
        self.deaths: dict[int, int] = {}
        if poison_after:
            self.deaths = dict(c.deaths)
            for o in c.running:
                self.deaths[o] = self.deaths.get(o, 0) + 1
            if self.base is not None:
                self.deaths = {o: n for o, n in self.deaths.items() if o >= self.base}
            if c.running:
                log.warning("%s: offsets %s were in progress when a consumer of this group ended without finishing "
                            "them: deaths now %s", tp, runs(c.running), _runs_text(self.deaths))
        self._skip = {o for o in c.done if self.base is None or o >= self.base}
        self._order: deque[int] = deque()  # fetched, not yet below the watermark, ascending
        self._running: set[int] = set()
        self._done: set[int] = set()  # finished, above the watermark
        self._next = self.base  # the offset after the last one fetched
        self.version = 0  # bumped by every change the next commit should carry
        self.committed_version = 0

    @property
    def watermark(self) -> int | None:
        """The offset to commit: the first fetched record not done, else the one after the last
        fetched (None before anything is known)."""
        return self._order[0] if self._order else self._next

    @property
    def running(self) -> frozenset[int]:
        """Offsets being handled now."""
        return frozenset(self._running)

    def seen(self, offset: int) -> bool:
        """Whether ``offset`` was fetched already under this assignment, or is below the committed
        offset it started from (offsets arrive in order)."""
        return self._next is not None and offset < self._next

    def fetched(self, offset: int) -> Fate:
        """Register a record just fetched (offsets arrive in order) and say what to do with it."""
        if self.base is None:
            self.base = offset
        self._order.append(offset)
        self._next = offset + 1
        if offset in self._skip:
            self._skip.discard(offset)
            return Fate.SKIP
        n = self.deaths.get(offset, 0)
        if self.poison_after and n >= self.poison_after:
            return Fate.POISON
        return Fate.SUSPECT if n else Fate.READ

    def started(self, offset: int) -> None:
        """The record went to its handler (the next commit names it running)."""
        self._running.add(offset)
        self.version += 1

    def finished(self, offset: int) -> None:
        """The record is done: its output is produced and acknowledged (or it was skipped)."""
        self._running.discard(offset)
        self._done.add(offset)
        while self._order and self._order[0] in self._done:
            self._done.discard(self._order.popleft())
        self.version += 1

    def death_count(self, offset: int) -> int:
        """Deaths counted for the record at ``offset`` (0 when never in progress at a death)."""
        return self.deaths.get(offset, 0)

    def commit(self, clear_running: bool = False) -> tuple[OffsetAndMetadata, int] | None:
        """What to commit now: the watermark with its metadata, and the version it carries (hand
        it to :meth:`acknowledged` once the commit succeeded); None when nothing is known yet.
        ``clear_running`` leaves the running records out (a rebalance is not a death)."""
        mark = self.watermark
        if mark is None:
            return None
        deaths = {o: n for o, n in self.deaths.items() if o >= mark}
        meta = write_metadata(mark, set() if clear_running else self._running, self._done, deaths)
        return OffsetAndMetadata(mark, meta), self.version

    def acknowledged(self, version: int) -> None:
        """A commit carrying ``version`` succeeded: deaths below its watermark are dropped."""
        self.committed_version = max(self.committed_version, version)
        mark = self.watermark
        if mark is not None:
            self.deaths = {o: n for o, n in self.deaths.items() if o >= mark}

    @property
    def dirty(self) -> bool:
        """Whether something changed since the last acknowledged commit."""
        return self.version > self.committed_version


def _runs_text(deaths: dict[int, int]) -> str:
    return write_metadata(min(deaths, default=0), set(), set(), deaths) or "none"
