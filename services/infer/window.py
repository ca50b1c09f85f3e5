"""The window runner: many records in flight at once, each produced the moment it is done, offsets
committed at each partition's low watermark. The infer stage runs on it (docs/delivery.md, "The
window").

Why: a batch runner (:mod:`services.common.runner`) hands its handler ``max_batch`` records and
takes the next batch only when the slowest is done. An OCR engine's pages differ by orders of
magnitude (a blank page: a few tokens; a dense receipt: thousands), so with a barrier after each
batch a GPU serving a VLM with continuous batching runs mostly empty. Here every record is its
own task:

1. **Fetch.** ``getmany`` fills one queue per lane (interactive, bulk) with decoded records, up to
   ``max_in_flight`` each; a lane's partitions are paused while its queue is full. Polling never
   stops, so ``max.poll.interval.ms`` is never exceeded.
2. **Start.** A free slot of the window takes the next record, interactive first. Each lane holds
   at most ``max_in_flight - interactive_reserve`` slots, so ``interactive_reserve`` slots are
   always there for an interactive record however much bulk work waits, and bulk always keeps as
   many (an interactive flood cannot starve it).
3. **Handle and produce.** :meth:`WindowHandler.handle_record` runs, with the batch runner's
   attempts, outage retries and poison handling, one record at a time; its messages are
   produced and acknowledged (``acks=all``) at once.
4. **Commit at the watermark.** The record is marked done in its partition's
   :class:`~services.infer.progress.PartitionProgress`; a committer commits each changed
   partition's low watermark (the first record not done) with metadata naming the records
   running and those done above it (at most every ``commit_interval_s`` when only finished
   records changed, at once when a record is about to start and deaths are counted). So
   at-least-once with idempotent writes stays the promise: a crash redoes only the records at or
   above the watermark that were not committed as done.

Deaths (``poison_after_deaths`` > 0): a record starts only once a commit naming it running has
been sent; a process assigned a partition counts a death for each record still named running
there. A record with a death is a *suspect*: no other record starts until the window is empty,
then it runs alone, so a record that kills the process again is the one counted; the records that
were only in flight beside it complete normally. A record with ``poison_after_deaths`` deaths
goes to :meth:`Handler.poison` unhandled (``stage_crash``).

Rebalances (aiokafka 0.12, eager protocol): the revocation drops the queued records of the
revoked partitions and commits each at its watermark with what is done above it and nothing
running (a rebalance is not a death); their records in flight finish and produce but commit
nothing. A record fetched again after its partition came back while its earlier copy is still in
flight here waits for that copy instead of being handled twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import abstractmethod
from collections import deque

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.structs import OffsetAndMetadata

from schemas.errors import ErrorCode
from schemas.lanes import PRIORITIES, Priority
from services.common.deaths import CommittedOffsetsReader
from services.common.errors import OcrError
from services.common.handler import Handler, poison_of
from services.common.kafka import Outgoing, RenewingProducer
from services.common.records import Record
from services.common.runner import MARK_SEND_TURNS, UNMARK_LOCK_S, StageRunner
from services.common.telemetry import Telemetry
from services.infer.progress import Fate, PartitionProgress, read_metadata

log = logging.getLogger(__name__)

Entry = tuple[Record, PartitionProgress, Fate]
"""A fetched record waiting for a slot: the record, its partition's progress, what to do with it."""


class WindowHandler(Handler):
    """A handler whose records are each handled on their own, many at once, each one's messages
    produced as soon as it is done: the window runner (:class:`WindowRunner`) drives it. A stage whose records take very different times (infer: a blank page or a dense
    receipt on a VLM) keeps its engine full this way instead of waiting for the slowest record
    of a batch.
    """

    @abstractmethod
    async def handle_record(self, record: Record) -> list[Outgoing]:
        """Process one record (its value decoded) and return every message it causes.

        Called concurrently for up to ``max_in_flight`` records, in any order within a partition.
        Must be idempotent: a record may be redelivered after a crash. Raise to fail the record
        (the runner retries an outage as long as it lasts and any other error up to
        ``max_attempts`` times, then :meth:`poison`). The record's consumer span is
        ``record.traced()`` / ``record.trace_headers()``; the runner ends it when the call returns.
        """

    def lane(self, topic: str) -> Priority:
        """The lane the records of ``topic`` are read in: ``interactive`` records take free slots
        first and have ``interactive_reserve`` slots of their own; default ``bulk``."""
        return "bulk"

    async def handle(self, records: list[Record]) -> list[Outgoing]:
        """Every record through :meth:`handle_record` at once (for a caller with a batch in
        hand: tests, benchmarks); raises the first failure after every record has ended."""
        got = await asyncio.gather(*(self.handle_record(r) for r in records), return_exceptions=True)
        if failed := next((g for g in got if isinstance(g, BaseException)), None):
            raise failed
        return [m for out in got for m in out]


class WindowRunner(StageRunner):
    """Runs a :class:`WindowHandler`'s records ``max_in_flight`` at a time (module docstring).

    It shares the batch runner's record processing (attempts, outage retries, poison, spans),
    producing and lag reporting, and replaces its loop, its commits and its rebalance steps.

    Args:
        stage: Stage name for logs and metrics.
        consumer: A consumer with auto-commit off, subscribed with ``listener=runner.listener``.
        producer: A started producer.
        handler: The stage's logic.
        telemetry: Metrics and tracing hooks.
        max_in_flight: Records in the window at once (>= 1).
        interactive_reserve: Slots only interactive records may take; each lane holds at most
            ``max_in_flight - interactive_reserve`` (0 <= reserve < max_in_flight).
        max_attempts: Attempts before a record is handed to ``Handler.poison``.
        max_backoff_s: Cap of the backoff between retries while a dependency is down, s.
        dlq_topic: Where the stub of a message too large to produce goes.
        size_limits: Topic -> its ``max.message.bytes``.
        poison_after_deaths: Deaths after which a record goes to the DLQ unhandled; 0 = off.
        read_committed: Reads the group's committed offsets with their metadata (what is done
            above the watermark, deaths); None = every partition starts with nothing known.
        commit_interval_s: Least time between two commits that only move watermarks, s.
    """

    def __init__(self, *, stage: str, consumer: AIOKafkaConsumer, producer: RenewingProducer,
                 handler: WindowHandler, telemetry: Telemetry, max_in_flight: int, interactive_reserve: int = 0,
                 max_attempts: int = 3, max_backoff_s: float = 10.0, dlq_topic: str = "ocr.dlq",
                 size_limits: dict[str, int] | None = None, poison_after_deaths: int = 0,
                 read_committed: CommittedOffsetsReader | None = None, commit_interval_s: float = 0.1):
        if max_in_flight < 1 or not 0 <= interactive_reserve < max_in_flight:
            raise ValueError(f"need max_in_flight >= 1 and 0 <= interactive_reserve < max_in_flight, got "
                             f"{max_in_flight}, {interactive_reserve}")
        super().__init__(stage=stage, consumer=consumer, producer=producer, handler=handler, telemetry=telemetry,
                         max_batch=max_in_flight, max_wait_ms=0, max_attempts=max_attempts,
                         max_backoff_s=max_backoff_s, dlq_topic=dlq_topic, size_limits=size_limits)
        self.handler: WindowHandler = handler
        self.window = max_in_flight
        self.reserve = interactive_reserve
        self.poison_after = poison_after_deaths
        self.commit_interval_s = commit_interval_s
        self._read = read_committed
        self._parts: dict[TopicPartition, PartitionProgress] = {}
        self._queues: dict[str, deque[Entry]] = {lane: deque() for lane in PRIORITIES}
        self._running = dict.fromkeys(PRIORITIES, 0)
        self._tasks: dict[tuple[str, int, int], asyncio.Task] = {}  # (topic, partition, offset) -> its task
        self._solo = False  # a suspect runs alone: nothing else starts
        self._stopping = False
        self._fatal: BaseException | None = None
        self._dirty = asyncio.Event()  # a partition's progress changed: commit
        self._mark_asked = asyncio.Event()  # a record waits for its running mark: commit now
        self._marks: list[asyncio.Future] = []
        self._last_commit = 0.0
        telemetry.window_slots.labels(stage, "max_in_flight").set(max_in_flight)
        telemetry.window_slots.labels(stage, "interactive_reserve").set(interactive_reserve)

    # -- the loop ------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Loop until ``stop`` is set; then let the records in flight finish and commit.

        Raises:
            Exception: a record's messages could not be produced for a reason other than an
                outage (the stage ends; with deaths counted, that record's death).
        """
        committer = asyncio.create_task(self._committer())
        try:
            while not stop.is_set():
                if self._fatal is not None:
                    raise self._fatal
                if not self._ready.is_set():
                    await asyncio.sleep(0.05)  # a rebalance: no record is taken until assigned
                    continue
                await self._fetch()
                self._dispatch()
                self._gauges()
                await self._idle()
            await self._drain()
        finally:
            committer.cancel()
            await asyncio.gather(committer, return_exceptions=True)

    async def _fetch(self) -> None:
        """Fill the lane queues from ``getmany`` (interactive partitions first), pausing the
        partitions of a lane whose queue is full; waits at most 0.2 s for records."""
        by_lane: dict[str, list[TopicPartition]] = {lane: [] for lane in PRIORITIES}
        for tp in self.consumer.assignment():
            by_lane[self.handler.lane(tp.topic)].append(tp)
        room = {lane: self.window - len(self._queues[lane]) for lane in PRIORITIES}
        for lane, tps in by_lane.items():
            if tps:
                (self.consumer.resume if room[lane] > 0 else self.consumer.pause)(*tps)
        if room["interactive"] > 0 and by_lane["interactive"]:
            self._route(await self.consumer.getmany(*by_lane["interactive"], timeout_ms=0,
                                                    max_records=room["interactive"]))
        got = await self.consumer.getmany(timeout_ms=200, max_records=max(1, sum(room.values())))
        self._route(got)

    def _route(self, got: dict) -> None:
        """Register fetched records with their partition's progress and queue them by lane; a
        record already done (the last commit said so) is finished at once. Records that come
        during a rebalance are dropped: an assigned partition is fetched again from its committed
        offset."""
        if not self._ready.is_set():
            return
        for tp, recs in got.items():
            prog = self._parts.get(tp)
            if prog is None:
                # fetched before its assignment was registered (aiokafka may hand out records of a
                # new assignment before on_partitions_assigned has returned): fetched again later
                if tp in self.consumer.assignment():
                    self.consumer.seek(tp, recs[0].offset)
                continue
            for r in recs:
                if prog.seen(r.offset):
                    continue  # fetched already under this assignment
                self.telemetry.messages_in.labels(self.stage, r.topic).inc()
                fate = prog.fetched(r.offset)
                if fate is Fate.SKIP:
                    prog.finished(r.offset)
                    self._dirty.set()
                    continue
                self._queues[self.handler.lane(r.topic)].append((self._decode(r), prog, fate))

    def _dispatch(self) -> None:
        """Start queued records in the free slots (module docstring, step 2). A suspect at the
        head of a queue waits until nothing is in flight, then runs alone."""
        while not self._stopping and not self._solo:
            total = sum(self._running.values())
            heads = [(lane, q[0]) for lane, q in self._queues.items() if q]
            suspect = next((lane for lane, (_, _, fate) in heads if fate is Fate.SUSPECT), None)
            if suspect is not None:
                if total == 0:
                    self._start(*self._queues[suspect].popleft(), lane=suspect, solo=True)
                return
            if total >= self.window:
                return
            lane = next((lane for lane, _ in heads if self._running[lane] < self.window - self.reserve), None)
            if lane is None:
                return
            self._start(*self._queues[lane].popleft(), lane=lane, solo=False)

    def _start(self, rec: Record, prog: PartitionProgress, fate: Fate, *, lane: str, solo: bool) -> None:
        prog.started(rec.offset)
        self._running[lane] += 1
        self._solo = solo
        mark = None
        if self.poison_after:
            mark = asyncio.get_running_loop().create_future()
            self._marks.append(mark)
            self._mark_asked.set()
        self._dirty.set()
        key = (rec.topic, rec.partition, rec.offset)
        earlier = self._tasks.get(key)  # its copy from an earlier assignment, still in flight here
        self.telemetry.lane_wait.labels(self.stage, lane).observe(rec.queue_wait_ms() / 1000)
        self._tasks[key] = asyncio.create_task(self._run_record(rec, prog, fate, lane, solo, mark, earlier))

    async def _run_record(self, rec: Record, prog: PartitionProgress, fate: Fate, lane: str, solo: bool,
                          mark: asyncio.Future | None, earlier: asyncio.Task | None) -> bool:
        """One record: handled (or poisoned, or its earlier copy awaited), its messages produced;
        True once done. Frees its slot and starts the next record on the way out."""
        key = (rec.topic, rec.partition, rec.offset)
        done = False
        try:
            if mark is not None:
                await mark  # the commit naming it running is sent (or failed, logged)
            if earlier is not None and await self._earlier_done(earlier):
                done = True
            elif fate is Fate.POISON:
                await self._poison_unhandled(rec, prog.death_count(rec.offset))
                done = True
            else:
                await self._produce(await self._process([rec]))
                await self._retrying(self.handler.after_produce)
                done = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a permanent producer error: the stage ends (the batch runner's rule)
            log.error("%s: %s[%d]@%d: its messages could not be produced (%r); stopping", self.stage, rec.topic,
                      rec.partition, rec.offset, exc)
            self._fatal = exc
        finally:
            self._running[lane] -= 1
            if solo:
                self._solo = False
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]
            if done and self._parts.get(TopicPartition(rec.topic, rec.partition)) is prog:
                prog.finished(rec.offset)
                self._dirty.set()
            self._dispatch()
        return done

    @staticmethod
    async def _earlier_done(earlier: asyncio.Task) -> bool:
        """Whether ``earlier`` (the same record's task of an earlier assignment) ended done."""
        try:
            return bool(await asyncio.shield(earlier))
        except BaseException:  # noqa: BLE001 - cancelled or failed: handle the record again
            if asyncio.current_task().cancelling():
                raise
            return False

    async def _poison_unhandled(self, rec: Record, deaths: int) -> None:
        """A record in progress at ``poison_after_deaths`` deaths: its DLQ event and error result."""
        log.error("%s: %s[%d]@%d was in progress when the stage died %d times: sent to the DLQ unhandled",
                  self.stage, rec.topic, rec.partition, rec.offset, deaths)
        self.telemetry.poison(self.stage, ErrorCode.STAGE_CRASH.value)
        exc = OcrError(ErrorCode.STAGE_CRASH, f"in progress when the {self.stage} stage died {deaths} times")
        await self._produce(await poison_of(self.handler, rec, exc, deaths))

    async def _drain(self) -> None:
        """After ``stop``: start nothing more, let the records in flight finish, commit."""
        self._stopping = True
        if self._tasks:
            log.info("%s: stopping: %d records in flight finish first", self.stage, len(self._tasks))
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await self._commit_now()

    def _gauges(self) -> None:
        for lane in PRIORITIES:
            self.telemetry.window_in_flight.labels(self.stage, lane).set(self._running[lane])
            self.telemetry.window_waiting.labels(self.stage, lane).set(len(self._queues[lane]))

    async def _idle(self) -> None:
        """Lag per partition, at most once a second (the handler's ``on_idle`` is not called)."""
        await self._report_lag()

    # -- commits -------------------------------------------------------------------------
    async def _committer(self) -> None:
        """Commit changed partitions: at once when a record waits for its running mark, else at
        most every ``commit_interval_s``."""
        while True:
            await self._dirty.wait()
            if not self._marks:
                wait = self._last_commit + self.commit_interval_s - time.monotonic()
                if wait > 0:
                    self._mark_asked.clear()
                    try:
                        await asyncio.wait_for(self._mark_asked.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
            self._dirty.clear()
            await self._commit_now()

    async def _commit_now(self) -> None:
        """One commit of every owned partition whose progress changed; the records waiting for
        their running mark go on once it is sent (``MARK_SEND_TURNS``, as the batch runner's
        marks) or acknowledged."""
        async with self._commit_lock:
            waiters, self._marks = self._marks, []
            self._mark_asked.clear()
            owned = self.consumer.assignment()
            snap: dict[TopicPartition, tuple[PartitionProgress, OffsetAndMetadata, int]] = {}
            for tp, prog in self._parts.items():
                if tp in owned and prog.dirty and (got := prog.commit()) is not None:
                    snap[tp] = (prog, *got)
            try:
                if not snap:
                    return
                task = asyncio.ensure_future(self.consumer.commit({tp: om for tp, (_, om, _) in snap.items()}))
                for _ in range(MARK_SEND_TURNS):
                    if task.done():
                        break
                    await asyncio.sleep(0)
                for w in waiters:
                    if not w.done():
                        w.set_result(None)
                try:
                    await task
                except (CommitFailedError, IllegalStateError, KafkaError) as exc:
                    log.warning("%s: commit failed (%r); the next one carries it", self.stage, exc)
                    self._dirty.set()
                    return
                for prog, _, version in snap.values():
                    prog.acknowledged(version)
                self._last_commit = time.monotonic()
                self.telemetry.commit(self.stage)
            finally:
                for w in waiters:
                    if not w.done():
                        w.set_result(None)

    # -- rebalances (the listener: services.common.rebalance.Revocations) ------------------
    def _revoke(self, revoked: set[TopicPartition]) -> None:
        """Drop the queued records of ``revoked``; their records in flight finish uncommitted."""
        self._ready.clear()
        dropped = 0
        for lane, q in self._queues.items():
            keep = deque(e for e in q if TopicPartition(e[0].topic, e[0].partition) not in revoked)
            dropped += len(q) - len(keep)
            self._queues[lane] = keep
        in_flight = sum(1 for (topic, part, _) in self._tasks if TopicPartition(topic, part) in revoked)
        self.telemetry.revoked(self.stage, in_flight, dropped)
        if in_flight or dropped:
            log.warning("%s: partitions %s revoked: %d records in flight will not be committed, %d queued records "
                        "dropped; the new owner redoes them", self.stage, sorted(revoked), in_flight, dropped)
        else:
            log.info("%s: partitions %s revoked (no records held)", self.stage, sorted(revoked))

    async def _unmark(self, revoked: set[TopicPartition]) -> None:
        """Commit each revoked partition at its watermark with what is done above it and nothing
        running (a rebalance is not a death), then forget its progress."""
        try:
            await asyncio.wait_for(self._commit_lock.acquire(), UNMARK_LOCK_S)
            locked = True
        except asyncio.TimeoutError:
            locked = False
            log.warning("%s: a commit in flight held the lock for %.0fs; committing the revoked partitions anyway",
                        self.stage, UNMARK_LOCK_S)
        try:
            owned = self.consumer.assignment()
            offsets = {}
            for tp in revoked:
                prog = self._parts.get(tp)
                if prog is not None and tp in owned and (got := prog.commit(clear_running=True)) is not None:
                    offsets[tp] = got[0]
            if offsets:
                await self.consumer.commit(offsets)
                log.info("%s: committed the revoked partitions %s at their watermarks, nothing running", self.stage,
                         sorted(offsets))
        except (CommitFailedError, IllegalStateError, KafkaError) as exc:
            log.warning("%s: could not commit the revoked partitions %s (%r): their next owner counts a death for "
                        "each record running", self.stage, sorted(revoked), exc)
        finally:
            for tp in revoked:
                self._parts.pop(tp, None)
            if locked:
                self._commit_lock.release()

    async def _assigned(self, assigned: set[TopicPartition]) -> None:
        """Read the committed offsets and metadata of ``assigned`` (what is done above the
        watermark, deaths), then the handler's :meth:`Handler.on_assigned`; no record is taken
        until both are done."""
        try:
            committed = await self._committed(sorted(assigned))
            for tp in assigned:
                if tp not in self._parts:  # kept across a rebalance that did not revoke it
                    om = committed.get(tp)
                    c = read_metadata(om.offset, om.metadata) if om is not None else None
                    self._parts[tp] = PartitionProgress(tp, c, self.poison_after)
            await self._retrying(lambda: self.handler.on_assigned(assigned))
        finally:
            self._ready.set()

    async def _committed(self, tps: list[TopicPartition], attempts: int = 8) -> dict[TopicPartition, OffsetAndMetadata]:
        """The group's committed offsets of ``tps``, retried with backoff (0.2 s doubling, 5 s
        at most); when every attempt fails the partitions start with nothing known (logged)."""
        if self._read is None or not tps:
            return {}
        for attempt in range(attempts):
            try:
                return await self._read(tps)
            except Exception as exc:  # noqa: BLE001 - any failure: retry, then go on without
                log.warning("%s: reading the committed offsets of %s failed (%r); retry %d", self.stage, tps, exc,
                            attempt + 1)
                await asyncio.sleep(min(5.0, 0.2 * 2**attempt))
        log.error("%s: cannot read the committed offsets of %s: deaths and records done above them are not known",
                  self.stage, tps)
        return {}
