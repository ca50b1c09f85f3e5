"""The consume -> handle -> produce -> commit loop every stage runs.

Delivery contract (at least once, idempotent writes downstream):

1. ``getmany`` collects up to ``max_batch`` records or waits ``max_wait_ms``.
2. The handler runs on the batch. While it runs, ``getmany`` keeps being called (every 0.2 s):
   up to one more batch is fetched and prefetched, then the assigned partitions are *paused*.
   aiokafka leaves the group when no ``getmany`` ran for ``max.poll.interval.ms``
   (``fetcher_idle_time``), so the consumer never exceeds it however long a batch takes;
   heartbeats flow from aiokafka's background task.
3. Every message the batch caused is produced and acknowledged (``acks=all``).
4. Only then are offsets committed, and only for partitions this consumer still owns: after a
   rebalance the old owner never commits for a partition it lost (see :class:`Revocations`).

Rebalances (aiokafka 0.12, eager protocol): ``on_partitions_revoked`` runs in aiokafka's
background coordination task, not inside ``getmany``, so it can run at any ``await`` of the
loop -- while the handler runs, while the batch is produced, while the next batch is assembled.
From the moment the revoke starts until the new assignment arrives, ``getmany`` does not return
(it waits for the assignment), so every record fetched after the callback belongs to the new
assignment. The callback does not wait for the batch in flight (a GPU batch may take minutes;
the whole group would wait for it); instead:

* records of revoked partitions that were fetched but not yet handled (the carry buffer and the
  batch being assembled) are dropped, and their prefetches are forgotten (``Handler.forget``);
  a partition that comes back is fetched again from its committed offset;
* the batch in flight finishes and its messages are produced, but no offset of a revoked
  partition is committed for it, even if the partition is assigned back meanwhile (its fetch
  position restarts at the committed offset, before that batch's records).

Results the old owner already produced for records of a lost partition stay: the new owner
redoes those records and every write downstream is idempotent (keyed by the content hash), so
a request still ends with one final state.

Records: every fetched record is decoded into a :class:`~services.common.records.Record` (its
value parsed into the event model the handler declared for its topic, :meth:`Handler.consumes`);
each hand-over to the handler gives every record a fresh consumer span (continuing the trace of
its ``traceparent`` header) that the handler makes current with ``Record.traced`` and passes on
with ``Record.trace_headers``; the runner ends the spans left open when the call returns. A record
whose value does not decode goes to :meth:`Handler.undecodable` (default: it fails like a record
the handler raised on). A message over its topic's ``max.message.bytes`` is replaced by what
:meth:`Handler.oversize` returns (default: a small DLQ stub). The runner knows no event schema.

Failures: a retriable error (store or broker down) is retried with capped exponential backoff
for as long as it lasts (logged, counted; :func:`services.common.retry.retry_outages`). Any other
error splits the batch into single records; a record failing ``max_attempts`` times is handed to
``Handler.poison`` (DLQ event and an error result) and the partition moves on. A retriable-looking error while the handler's
dependencies answer (:meth:`Handler.dependencies_ok` returns True: a packet the database
refuses and drops the connection over, say) is the batch's own: it is split and counted the
same way; only when a dependency does not answer (or the handler cannot tell) is it an outage.

Deaths (``poison_after_deaths`` > 0, :mod:`services.common.deaths`, docs/delivery.md "Poison
records across restarts"): before a batch is handled, each of its partitions is committed where it
is with commit metadata naming the batch's offsets in progress; a consumer assigned a partition
whose metadata still names records in progress counts one death for each. A batch holding a record
with a death is handled one record at a time; a record with ``poison_after_deaths`` deaths goes to
``Handler.poison`` as ``stage_crash`` unhandled. A rebalance is not a death: the revocation callback
commits the partitions back with nothing in progress. Marks, commits and that clearing commit are
serialised by one lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from schemas.errors import ErrorCode
from services.common.deaths import DeathLedger, CommittedOffsetsReader
from services.common.errors import OcrError, is_transient
from services.common.handler import Handler, poison_of
from services.common.kafka import Outgoing, RenewingProducer
from services.common.producing import BatchProducer
from services.common.rebalance import Revocations
from services.common.records import RecordParser, Record
from services.common.retry import capped_backoff_s, retry_outages
from services.common.telemetry import Telemetry

log = logging.getLogger(__name__)


DEPENDENCY_CHECK_S = 10.0
"""Bound on one :meth:`Handler.dependencies_ok` call, s; a check that takes longer counts as "down"."""

MARK_SEND_TURNS = 10
"""Event-loop turns a batch waits for its in-progress mark to be *sent* before it is handled
(unless it is acknowledged sooner). The acknowledgement comes after the broker's
``group.coordinator.append.linger.ms`` (5 ms by default on Kafka 4.x: ~6 ms a commit on the local
broker), but a commit request the broker has received is applied even if the client is
SIGKILLed right after: measured on the local Kafka 4.1 broker with aiokafka 0.12, 5 of 5 marks
landed when the process was killed 3 turns (or 0.5 ms, 2 ms) after the commit began, 0 of 5
after 1 turn (not sent yet). aiokafka writes the request on the second turn when the
coordinator is known; 10 leaves a margin. The batch's own commit waits for the acknowledgement."""

UNMARK_LOCK_S = 10.0
"""How long the revocation callback waits for a commit in flight before clearing marks, s."""


class StageRunner:
    """Runs one stage's consumer loop until ``stop`` is set, then drains and commits.

    Args:
        stage: Stage name for logs and metrics (``ingest``, ``dedup``, ``infer``, ``sink``).
        consumer: A consumer with auto-commit off, subscribed with ``listener=runner.listener``
            (construct the runner first, then subscribe and start the consumer). Without the
            listener the runner still skips partitions missing from ``assignment()`` at commit
            time, but cannot drop records fetched before a rebalance.
        producer: A started producer.
        handler: The stage's logic; its :meth:`Handler.consumes` is asked once, here.
        telemetry: Metrics and tracing hooks.
        max_batch: Most records per batch.
        max_wait_ms: Longest time to wait for a batch to fill; a lone record never waits longer.
        max_attempts: Attempts before a record is handed to ``Handler.poison``.
        max_backoff_s: Cap of the backoff between retries while a dependency is down.
        dlq_topic: Where the stub of a message too large to produce goes (:meth:`Handler.oversize`).
        size_limits: Topic -> its ``max.message.bytes``
            (:func:`services.common.kafka.topic_message_limits`): a message over its topic's
            limit is replaced (:meth:`Handler.oversize`) before it is sent, never refused by the broker.
        poison_after_deaths: Deaths after which a record is sent to the DLQ unhandled (see the
            module docstring); 0 = off (no marks, no extra commit).
        read_committed: Reads the group's committed offsets with metadata
            (:func:`services.common.deaths.admin_reader`); required when ``poison_after_deaths`` > 0.
        drain_on_revoke: The revocation callback first waits (at most ``drain_timeout_s``) for the
            batch in flight to be produced and committed, as Kafka Streams commits a task before
            it is revoked: for a stage with keyed state whose next owner must find every change
            of it in the changelog (dedup). Only for short batches: the group waits meanwhile.
        drain_timeout_s: Bound of that wait, s.
    """

    def __init__(
        self,
        *,
        stage: str,
        consumer: AIOKafkaConsumer,
        producer: RenewingProducer,
        handler: Handler,
        telemetry: Telemetry,
        max_batch: int = 64,
        max_wait_ms: int = 20,
        max_attempts: int = 3,
        max_backoff_s: float = 10.0,
        dlq_topic: str = "ocr.dlq",
        size_limits: dict[str, int] | None = None,
        poison_after_deaths: int = 0,
        read_committed: CommittedOffsetsReader | None = None,
        drain_on_revoke: bool = False,
        drain_timeout_s: float = 30.0,
    ):
        self.stage = stage
        self.consumer = consumer
        self.producer = producer
        self.handler = handler
        self.telemetry = telemetry
        self.max_batch = max_batch
        self.max_wait_ms = max_wait_ms
        self.max_attempts = max_attempts
        self.max_backoff_s = max_backoff_s
        self.dlq_topic = dlq_topic
        self.size_limits = size_limits or {}
        self._producing = BatchProducer(stage=stage, producer=producer, telemetry=telemetry,
                                        size_limits=self.size_limits, dlq_topic=dlq_topic, max_attempts=max_attempts,
                                        oversize=handler.oversize, delay=self._delay, on_retry=self._on_retry)
        self._decode = RecordParser(handler.consumes())
        self._carry: list[Record] = []  # fetched, not yet handled (the batch being assembled, then the next)
        self._in_flight: list[Record] = []  # the batch being handled, produced and committed
        self._lost: set[TopicPartition] = set()  # partitions revoked since the batch in flight was taken
        self.listener = Revocations(self)
        self._last_idle = 0.0
        self._last_lag = 0.0
        if poison_after_deaths and read_committed is None:
            raise ValueError("poison_after_deaths needs read_committed")
        self.deaths = DeathLedger(stage, poison_after_deaths, read_committed) if poison_after_deaths else None
        self._commit_lock = asyncio.Lock()  # marks, commits and the revocation's clearing, one at a time
        # cleared by a revocation, set once the next assignment's deaths are read and the handler's
        # on_assigned has returned: aiokafka may hand out records of a new assignment before
        # on_partitions_assigned has run (or returned)
        self._ready = asyncio.Event()
        self._ready.set()
        self.drain_on_revoke = drain_on_revoke
        self.drain_timeout_s = drain_timeout_s
        self._between_batches = asyncio.Event()  # set while no batch is in flight
        self._between_batches.set()
        self._revoking = False

    # -- public -------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Loop until ``stop`` is set. The batch in progress is finished and committed first."""
        while not stop.is_set():
            records = await self._next_batch()
            if not records:
                await self._idle()
                continue
            self.telemetry.batch_in(self.stage, records)
            started = time.perf_counter()
            await self._ready.wait()
            self._between_batches.clear()
            try:
                if self.deaths is not None and self.deaths.any_suspect(records):
                    await self._one_by_one(records, stop)
                else:
                    await self._batch(records)
            finally:
                self._between_batches.set()
            self._in_flight = []
            self.telemetry.batch_done(self.stage, len(records), time.perf_counter() - started)
            await self._idle()  # housekeeping runs under load too (at most once a second)

    async def _batch(self, records: list[Record]) -> None:
        """Mark, handle, produce, commit."""
        await self._mark(records)
        outgoing = await self._with_keepalive(self._process(records))
        await self._produce(outgoing)
        await self._retrying(self.handler.after_produce)
        await self._commit(records)

    async def _one_by_one(self, records: list[Record], stop: asyncio.Event) -> None:
        """A batch holding a record with a death: each record alone, marked alone; a record with
        ``poison_after_deaths`` deaths goes to ``Handler.poison`` unhandled. Stops early when
        ``stop`` is set (the rest was never marked: redelivered, no death)."""
        assert self.deaths is not None
        log.warning("%s: %d records, some in progress at an earlier death: handling them one at a time (%s)",
                    self.stage, len(records), self.deaths.snapshot())
        for rec in records:
            if stop.is_set():
                break
            if TopicPartition(rec.topic, rec.partition) in self._lost:
                continue  # revoked meanwhile: its next owner has it
            deaths = self.deaths.deaths(rec)
            if deaths < self.deaths.poison_after:
                await self._batch([rec])
                continue
            log.error("%s: %s[%d]@%d was in progress when the stage died %d times: sent to the DLQ unhandled",
                      self.stage, rec.topic, rec.partition, rec.offset, deaths)
            self.telemetry.poison(self.stage, ErrorCode.STAGE_CRASH.value)
            exc = OcrError(ErrorCode.STAGE_CRASH, f"in progress when the {self.stage} stage died {deaths} times")
            await self._produce(await poison_of(self.handler, rec, exc, deaths))
            await self._retrying(self.handler.after_produce)
            await self._commit([rec])

    # -- steps --------------------------------------------------------------------------
    async def _next_batch(self) -> list[Record]:
        """Up to ``max_batch`` records; waits at most ``max_wait_ms`` after the first one arrives.

        Records are gathered in the carry buffer (so a revocation during the wait drops them
        there) and taken out only when the batch goes in flight.
        """
        if not self._carry:
            got = await self.consumer.getmany(timeout_ms=1000, max_records=self.max_batch)
            self._carry.extend(self._decode(r) for recs in got.values() for r in recs)
            if not self._carry:
                return []
        deadline = time.monotonic() + self.max_wait_ms / 1000
        while len(self._carry) < self.max_batch:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                break
            got = await self.consumer.getmany(timeout_ms=remaining_ms, max_records=self.max_batch - len(self._carry))
            self._carry.extend(self._decode(r) for recs in got.values() for r in recs)
        records, self._carry = self._carry[: self.max_batch], self._carry[self.max_batch :]
        # Every record left in the carry was fetched under the current assignment (a revocation
        # drops the others), so the batch starts with no lost partitions.
        self._in_flight, self._lost = records, set()
        return records

    def _revoke(self, revoked: set[TopicPartition]) -> None:
        """Rebalance callback (see the module docstring): drop carried records of ``revoked`` and
        their prefetches; the batch in flight will not commit them."""
        def gone(r: Record) -> bool:
            return TopicPartition(r.topic, r.partition) in revoked

        self._ready.clear()
        dropped = [r for r in self._carry if gone(r)]
        self._carry = [r for r in self._carry if not gone(r)]
        in_flight = [r for r in self._in_flight if gone(r)]
        self._lost |= revoked
        if dropped:
            try:
                self.handler.forget(dropped)
            except Exception as exc:  # a failing cleanup must not break the rebalance
                log.warning("%s: forgetting prefetches failed: %r", self.stage, exc)
        self.telemetry.revoked(self.stage, len(in_flight), len(dropped))
        if in_flight or dropped:
            held = ", ".join(sorted({f"{r.topic}[{r.partition}]" for r in in_flight}))
            log.warning("%s: partitions %s revoked: %d records of the batch in flight (%s) will not be committed, "
                        "%d carried records dropped; the new owner redoes them",
                        self.stage, sorted(revoked), len(in_flight), held, len(dropped))
        else:
            log.info("%s: partitions %s revoked (no records held)", self.stage, sorted(revoked))

    async def _assigned(self, assigned: set[TopicPartition]) -> None:
        """Assignment callback: read the deaths recorded in the commit metadata of ``assigned`` and
        let the handler restore its state (:meth:`Handler.on_assigned`, retried while it fails
        transiently); no batch is taken until both are done."""
        try:
            if self.deaths is not None:
                await self.deaths.load(assigned)
            await self._retrying(lambda: self.handler.on_assigned(assigned))
        finally:
            self._ready.set()

    async def _drain_for_revoke(self) -> None:
        """Revocation callback, with ``drain_on_revoke``: wait for the batch in flight to finish
        (produced, committed), at most ``drain_timeout_s``; the keepalive stops polling meanwhile
        (a ``getmany`` during a rebalance waits for the new assignment)."""
        if not self.drain_on_revoke or self._between_batches.is_set():
            return
        self._revoking = True
        try:
            await asyncio.wait_for(self._between_batches.wait(), self.drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("%s: the batch in flight did not finish within %.0fs of a revocation; its records are redone "
                        "by the next owner", self.stage, self.drain_timeout_s)
        finally:
            self._revoking = False

    async def _mark(self, records: list[Record]) -> None:
        """Commit each partition of ``records`` where it is, naming them in progress (one commit).
        Returns once it is acknowledged or after ``MARK_SEND_TURNS`` loop turns (sent by then);
        the batch's own commit takes the lock after it. A failed mark is logged: the batch runs unmarked (a death
        during it is not counted)."""
        if self.deaths is None:
            return
        task = asyncio.ensure_future(self._mark_commit(records))
        for _ in range(MARK_SEND_TURNS):
            if task.done():
                break
            await asyncio.sleep(0)

    async def _mark_commit(self, records: list[Record]) -> None:
        assert self.deaths is not None
        async with self._commit_lock:
            owned = self.consumer.assignment()
            mine = [r for r in records if (tp := TopicPartition(r.topic, r.partition)) in owned and tp not in self._lost]
            offsets = self.deaths.mark(mine)
            if not offsets:
                return
            try:
                await self.consumer.commit(offsets)
            except (CommitFailedError, IllegalStateError, KafkaError) as exc:
                log.warning("%s: could not mark %d records in progress (%r): a death during them is not counted",
                            self.stage, len(mine), exc)

    async def _unmark(self, revoked: set[TopicPartition]) -> None:
        """Revocation callback: commit the marked partitions of ``revoked`` back with nothing in
        progress. Waits for a commit in flight first (at most ``UNMARK_LOCK_S``)."""
        if self.deaths is None:
            return
        try:
            await asyncio.wait_for(self._commit_lock.acquire(), UNMARK_LOCK_S)
            locked = True
        except asyncio.TimeoutError:
            locked = False
            log.warning("%s: a commit in flight held the lock for %.0fs; clearing the marks anyway", self.stage,
                        UNMARK_LOCK_S)
        try:
            offsets = self.deaths.unmark(revoked)
            if offsets:
                await self.consumer.commit(offsets)
                log.info("%s: cleared the in-progress marks of %s (a rebalance is not a death)", self.stage,
                         sorted(offsets))
        except (CommitFailedError, IllegalStateError, KafkaError) as exc:
            log.warning("%s: could not clear the in-progress marks of %s (%r): their next owner counts a death",
                        self.stage, sorted(revoked), exc)
        finally:
            if locked:
                self._commit_lock.release()

    async def _idle(self) -> None:
        now = time.monotonic()
        if now - self._last_idle < 1.0:
            return
        self._last_idle = now
        await self._report_lag()
        self._between_batches.clear()  # a revocation with drain_on_revoke waits for housekeeping too
        try:
            try:
                out = await self.handler.on_idle()
            except Exception as exc:  # housekeeping must never stop the loop
                log.warning("%s: idle housekeeping failed: %r", self.stage, exc)
                return
            if out:
                await self._produce(out)
                await self._retrying(self.handler.after_produce)
        finally:
            self._between_batches.set()

    async def _with_keepalive(self, coro):
        """Run ``coro`` (the batch) while the consumer keeps polling.

        Up to one more batch of records is fetched meanwhile and its decoded records handed to
        :meth:`Handler.prefetch` (pipelining: the next batch's I/O overlaps this batch's
        compute); once that buffer is full the partitions are paused, so memory stays bounded.
        Polling never stops, so ``max.poll.interval.ms`` is never exceeded.
        """
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.2)
                if done:
                    return task.result()
                if self._revoking:
                    continue  # a revocation waits for this batch: no poll until it is done
                assigned = self.consumer.assignment()
                room = self.max_batch - len(self._carry)
                if room > 0:
                    self.consumer.resume(*assigned)
                else:
                    self.consumer.pause(*assigned)
                got = await self.consumer.getmany(timeout_ms=0, max_records=max(1, room))
                new = [self._decode(r) for recs in got.values() for r in recs]
                self._carry.extend(new)
                if decoded := [r for r in new if r.error is None]:
                    self.handler.prefetch(decoded)
        finally:
            if not task.done():
                task.cancel()
            self.consumer.resume(*self.consumer.assignment())

    async def _dependencies_answer(self, exc: BaseException) -> bool:
        """After a retriable-looking ``exc``: True if the handler says every dependency answers
        (the failure is the records' own), False if not, if it cannot tell, or if asking fails."""
        try:
            ok = await asyncio.wait_for(self.handler.dependencies_ok(), DEPENDENCY_CHECK_S)
        except Exception as err:  # noqa: BLE001 - a failing or slow check means "down"
            log.info("%s: dependency check failed (%r)", self.stage, err)
            return False
        if ok is True:
            log.warning("%s: %r although every dependency answers: counted as a failure of the records", self.stage, exc)
        return ok is True

    async def _handle(self, records: list[Record]) -> list[Outgoing]:
        """One call of the handler: every record with a fresh consumer span; the undecodable ones
        to :meth:`Handler.undecodable` (together, each in its span), then the rest to
        :meth:`Handler.handle`. Spans the handler left open are ended on return (with the
        exception, when the call raised)."""
        traced = [r.with_span(self.telemetry, self.stage) for r in records]
        failure: BaseException | None = None
        try:
            out: list[Outgoing] = []
            if bad := [r for r in traced if r.error is not None]:
                for msgs in await asyncio.gather(*(self._undecodable(r) for r in bad)):
                    out.extend(msgs)
            if good := [r for r in traced if r.error is None]:
                out.extend(await self.handler.handle(good))
            return out
        except BaseException as exc:
            failure = exc
            raise
        finally:
            for r in traced:
                r.trace.end(failure)

    async def _undecodable(self, record: Record) -> list[Outgoing]:
        with record.traced():
            return await self.handler.undecodable(record, record.error)

    async def _outage(self, exc: Exception) -> bool:
        """Whether ``exc`` of a handler call is an outage (retried as long as it lasts)."""
        return is_transient(exc) and not await self._dependencies_answer(exc)

    async def _process(self, records: list[Record]) -> list[Outgoing]:
        """Handle the batch; on failure retry (an outage) or isolate poison records."""
        try:
            return await retry_outages(lambda: self._handle(records), outage=self._outage, delay=self._delay,
                                       on_retry=self._on_retry)
        except Exception as exc:
            if len(records) == 1:
                return await self._process_single(records[0], exc)
            log.warning("%s: batch of %d failed (%r); retrying one by one", self.stage, len(records), exc)
            out: list[Outgoing] = []
            for rec in records:
                out.extend(await self._process_single(rec, None))
            return out

    async def _process_single(self, record: Record, first_exc: BaseException | None) -> list[Outgoing]:
        """``record`` alone until it goes through, or fails ``max_attempts`` times in all (then
        :meth:`Handler.poison`). An outage is retried as long as it lasts and is not an attempt; a
        retriable-looking failure while the dependencies answer is one, after a pause. Both waits
        grow with the retriable-looking failures so far."""
        attempts = 1 if first_exc is not None else 0
        last_exc = first_exc
        transient_tries = 0

        async def outage(exc: Exception) -> bool:
            nonlocal transient_tries
            if not is_transient(exc):
                return False
            transient_tries += 1
            return not await self._dependencies_answer(exc)

        while attempts < self.max_attempts:
            try:
                return await retry_outages(lambda: self._handle([record]), outage=outage,
                                           delay=lambda _: self._delay(transient_tries),
                                           on_retry=lambda _, exc, s: self._on_retry(transient_tries, exc, s))
            except Exception as exc:
                if is_transient(exc):  # the dependencies answer: the record's own failure, after a pause
                    await asyncio.sleep(self._delay(transient_tries))
                attempts += 1
                last_exc = exc
                log.warning(
                    "%s: %s[%d]@%d failed attempt %d/%d: %r",
                    self.stage, record.topic, record.partition, record.offset, attempts, self.max_attempts, exc,
                )
        assert last_exc is not None
        log.error("%s: %s[%d]@%d is poison, sending to DLQ: %r",
                  self.stage, record.topic, record.partition, record.offset, last_exc)
        self.telemetry.poison(self.stage, getattr(getattr(last_exc, "code", None), "value", "internal_error"))
        return await poison_of(self.handler, record, last_exc, attempts)

    async def _retrying(self, fn) -> None:
        """Await ``fn()``, retrying while it fails with a transient error."""
        return await retry_outages(fn, delay=self._delay, on_retry=self._on_retry)

    def _delay(self, attempt: int) -> float:
        """Backoff before retry ``attempt`` (1, 2, ...), s: 0.4 doubling, at most ``max_backoff_s``."""
        return capped_backoff_s(attempt, self.max_backoff_s)

    def _on_retry(self, attempt: int, exc: BaseException, delay: float) -> None:
        self.telemetry.dependency_retry(self.stage, type(exc).__name__)
        log.warning("%s: dependency unavailable (%r); retry %d in %.1fs", self.stage, exc, attempt, delay)

    async def _produce(self, outgoing: list[Outgoing]) -> None:
        """Send every message and wait for all acknowledgements (:meth:`BatchProducer.produce`)."""
        await self._producing.produce(outgoing)

    async def _report_lag(self) -> None:
        """Consumer lag per assigned partition (highwater - position), at most once a second."""
        now = time.monotonic()
        if now - self._last_lag < 1.0:
            return
        self._last_lag = now
        lags: dict[TopicPartition, int] = {}
        for tp in self.consumer.assignment():
            if tp not in self.consumer.assignment():
                continue  # revoked during an earlier ``await position``: highwater() would assert
            high = self.consumer.highwater(tp)
            if high is None:
                continue
            try:
                pos = await asyncio.wait_for(self.consumer.position(tp), 0.5)
            except Exception:  # no position yet (being reset) or a rebalance: skip this time
                continue
            lags[tp] = max(0, high - pos)
        self.telemetry.lag(self.stage, lags)

    async def _commit(self, records: list[Record]) -> None:
        """Commit the next offset of every partition in the batch that was not revoked while the
        batch was in flight and is still assigned."""
        last: dict[TopicPartition, int] = defaultdict(lambda: -1)
        for r in records:
            tp = TopicPartition(r.topic, r.partition)
            last[tp] = max(last[tp], r.offset)
        async with self._commit_lock:
            owned = self.consumer.assignment()
            offsets = {tp: off + 1 for tp, off in last.items() if tp in owned and tp not in self._lost}
            lost = set(last) - set(offsets)
            if lost:
                log.warning("%s: not committing %s: partitions were revoked during the batch", self.stage, sorted(lost))
            if not offsets:
                return
            try:
                # with deaths on, the commit also clears the in-progress mark (only deaths still ahead stay)
                await self.consumer.commit(self.deaths.done(offsets) if self.deaths is not None else offsets)
                if self.deaths is not None:
                    self.deaths.committed(offsets)
                self.telemetry.commit(self.stage)
            except (CommitFailedError, IllegalStateError) as exc:
                log.warning("%s: commit failed after a rebalance (%r); records will be redelivered", self.stage, exc)
            except KafkaError as exc:
                log.warning("%s: commit failed (%r); records will be redelivered", self.stage, exc)
