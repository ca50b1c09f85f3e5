"""Dedup's keyed state for one partition: which cache keys are in flight, who waits on them, and
which were settled a moment ago. Pure logic: no I/O (the changelog and Kafka are in
:mod:`services.dedup.changelog` and the handler).

Every event is keyed by the image's SHA-256, so all copies of an image, and the settlement of
its cache key (the sink produces it to the same topic), come through one partition of
``ocr.requests``, to one dedup process, in order (Kafka's own consumer group). That process alone
owns the partition's state, so no lease, lock or deadline is needed: the holder's
settlement always arrives, because every stage commits only after its output is durable.

The state is backed up to a compacted changelog topic, partition p for partition p, as Kafka
Streams' state stores and faust Tables are. Each change is one small record:

* ``f|<cache key>`` -> the holder (the request computed for the key): :class:`InFlight` head.
* ``w|<cache key>|<request id>`` -> one waiting copy (its RequestEvent and arrival offset). The
  first ``max_waiters`` of a key are also held in memory; the others wait in the changelog only
  (spilled) and are read back when the key settles, so however many copies arrive, none is
  computed again and memory stays bounded.
* ``s|<cache key>`` -> the key's settled result pointer (:class:`Settled`).

A removed entry is a tombstone (value None). Changes are collected per handler call
(:meth:`PartitionState.writes`); a failed call is rolled back (:meth:`PartitionState.rollback`) so
that handling the record again decides the same.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import orjson

from schemas.errors import RETRYABLE_CODES, ErrorCode
from schemas.events import RequestEvent, SettledEvent
from schemas.reading import ErrorInfo

_MISSING = object()


@dataclass(frozen=True)
class Settled:
    """A key settled a moment ago: where its result is and who computed it.

    Attributes:
        result_uri: The stored result document (``s3://``).
        at_ms: When it was settled (the settlement's ``settled_at_ms``), epoch ms.
        engine, model, model_revision: Of the result.
    """

    result_uri: str
    at_ms: int
    engine: str | None = None
    model: str | None = None
    model_revision: str | None = None


@dataclass(frozen=True)
class InFlight:
    """A key being computed: its holder (the request sent to inference) and the waiting copies.

    Attributes:
        holder: The request computed for the key; None only for waiters restored without their
            holder record (see :meth:`PartitionState.unheld`).
        attempt: The holder's attempt (1, then +1 per promotion after a retryable failure).
        near_hash: The holder's page pHash (64 bits) when the near-duplicate lookup computed it,
            so the image is indexed from its settled result.
        near_space: The near-duplicate index space of that hash.
        waiters: The waiting copies held in memory, oldest first: (arrival offset, request).
        spilled: Waiting copies past ``max_waiters``, kept in the changelog only (``w|`` records,
            as every waiter) and answered from there at settlement.
    """

    holder: RequestEvent | None
    attempt: int = 1
    near_hash: int | None = None
    near_space: str | None = None
    waiters: tuple[tuple[int, RequestEvent], ...] = ()
    spilled: int = 0


@dataclass(frozen=True)
class Lookup:
    """What the state says about a request before any cache is asked.

    ``kind``: ``replay`` (this request id is already in flight: nothing to do), ``settled``
    (answer from ``settled``), ``joinable`` (in flight, room among the waiters held in memory),
    ``spill`` (in flight, no room in memory: the copy waits in the changelog only) or ``absent``.
    """

    kind: str
    settled: Settled | None = None


@dataclass
class Settlement:
    """What a settlement asks the handler to send.

    Attributes:
        answered: Waiting copies to complete with the result (``ok``) or with ``error``.
        error: The error shared with ``answered``, or None (answered from ``settled``).
        settled: The result pointer (``ok``).
        promoted: A waiter that became the holder after a retryable failure: send it to
            inference with ``attempt``.
        attempt: The promoted waiter's attempt.
        index: ``(near_space, near_hash, content_sha256)`` to add to the near-duplicate index, or None.
        spilled: Waiting copies of the key in the changelog only (:meth:`PartitionState.spill`):
            the caller reads them (:meth:`PartitionState.spilled_waiters`) and answers them as
            ``answered``.
    """

    answered: list[RequestEvent] = field(default_factory=list)
    error: ErrorInfo | None = None
    settled: Settled | None = None
    promoted: RequestEvent | None = None
    attempt: int = 1
    index: tuple[str, int, str] | None = None
    spilled: int = 0


def _req_json(req: RequestEvent) -> bytes:
    return req.model_dump_json(by_alias=True).encode()


class PartitionState:
    """The state of one partition (see the module docstring).

    Args:
        partition: The partition number (of ``ocr.requests``, ``ocr.settled`` and the changelog).
        max_waiters: Waiting copies held in memory per key; past it a copy waits in the changelog
            only (:meth:`spill`), never computed again.
        settled_window_ms: How long a settled key is answered from here, ms.
        settled_max_keys: Settled keys kept; past it the oldest is evicted first.
        max_attempts: Attempts across the key (``OCRSTREAM_MAX_ATTEMPTS``) before a retryable
            failure is shared with the waiters instead of promoting one.
    """

    def __init__(self, partition: int, *, max_waiters: int, settled_window_ms: int, settled_max_keys: int,
                 max_attempts: int):
        self.partition = partition
        self.max_waiters = max_waiters
        self.settled_window_ms = settled_window_ms
        self.settled_max_keys = settled_max_keys
        self.max_attempts = max_attempts
        self.inflight: dict[str, InFlight] = {}
        self.settled: OrderedDict[str, Settled] = OrderedDict()  # oldest settlement first
        self.ids: dict[str, str] = {}  # request id in flight (holder or waiter) -> cache key
        self.pending: dict[bytes, bytes | None] = {}  # changelog key -> value (None = tombstone), not yet written
        self._undo: list[tuple[dict, object, object]] = []

    # -- journal ----------------------------------------------------------------------------
    def _set(self, d: dict, k, v) -> None:
        self._undo.append((d, k, d.get(k, _MISSING)))
        d[k] = v

    def _del(self, d: dict, k) -> None:
        if k in d:
            self._undo.append((d, k, d[k]))
            del d[k]

    def keep(self) -> None:
        """The handler call succeeded: its changes stay (and are written with :meth:`writes`)."""
        self._undo.clear()

    def rollback(self) -> None:
        """The handler call failed: undo every change since the last :meth:`keep`."""
        while self._undo:
            d, k, old = self._undo.pop()
            if old is _MISSING:
                d.pop(k, None)
            else:
                d[k] = old

    def writes(self) -> list[tuple[bytes, bytes | None]]:
        """Take the changelog records of the kept changes (key, value or None), holder records last
        (a crash part-way through leaves the key in flight, and the replayed settlement ends it)."""
        out = sorted(self.pending.items(), key=lambda kv: kv[0].startswith(b"f|"))
        self.pending = {}
        return out

    # -- records ----------------------------------------------------------------------------
    def _put_head(self, key: str, f: InFlight) -> None:
        self._set(self.inflight, key, f)
        head = None if f.holder is None else orjson.dumps({
            "key": key, "holder": orjson.Fragment(_req_json(f.holder)), "attempt": f.attempt,
            "near_hash": f.near_hash, "near_space": f.near_space})
        self._set(self.pending, b"f|" + key.encode(), head)

    def _put_waiter(self, key: str, offset: int, req: RequestEvent) -> None:
        self._set(self.pending, f"w|{key}|{req.request_id}".encode(), orjson.dumps({
            "key": key, "offset": offset, "request": orjson.Fragment(_req_json(req))}))

    def _drop_waiter(self, key: str, req: RequestEvent) -> None:
        self._set(self.pending, f"w|{key}|{req.request_id}".encode(), None)

    def _put_settled(self, key: str, s: Settled) -> None:
        self._del(self.settled, key)
        self._set(self.settled, key, s)
        self._set(self.pending, b"s|" + key.encode(), orjson.dumps({"key": key, **s.__dict__}))
        while len(self.settled) > self.settled_max_keys:
            self._evict(next(iter(self.settled)))

    def _evict(self, key: str) -> None:
        self._del(self.settled, key)
        self._set(self.pending, b"s|" + key.encode(), None)

    def _end(self, key: str, f: InFlight) -> None:
        """Remove the key from flight: its head, its waiters and their ids."""
        self._del(self.inflight, key)
        self._set(self.pending, b"f|" + key.encode(), None)
        for _, w in f.waiters:
            self._drop_waiter(key, w)
            self._del(self.ids, w.request_id)
        if f.holder is not None:
            self._del(self.ids, f.holder.request_id)

    # -- transitions ------------------------------------------------------------------------
    def lookup(self, key: str, request_id: str, now_ms: int) -> Lookup:
        """What the state says about a request for ``key`` (see :class:`Lookup`); changes nothing."""
        if request_id in self.ids:
            return Lookup("replay")
        s = self.settled.get(key)
        if s is not None and now_ms - s.at_ms <= self.settled_window_ms:
            return Lookup("settled", s)
        f = self.inflight.get(key)
        if f is None:
            return Lookup("absent")
        return Lookup("joinable" if len(f.waiters) < self.max_waiters else "spill")

    def lead(self, key: str, req: RequestEvent, near_hash: int | None = None, near_space: str | None = None) -> None:
        """``req`` is computed for ``key``: it becomes the holder (the caller sends it to inference)."""
        self._put_head(key, InFlight(req, 1, near_hash, near_space))
        self._set(self.ids, req.request_id, key)

    def join(self, key: str, offset: int, req: RequestEvent) -> None:
        """``req`` waits for ``key``'s holder (after :meth:`lookup` said ``joinable``)."""
        f = self.inflight[key]
        self._set(self.inflight, key, InFlight(f.holder, f.attempt, f.near_hash, f.near_space,
                                               (*f.waiters, (offset, req)), f.spilled))
        self._put_waiter(key, offset, req)
        self._set(self.ids, req.request_id, key)

    def spill(self, key: str, offset: int, req: RequestEvent) -> None:
        """``req`` waits for ``key``'s holder in the changelog only (after :meth:`lookup` said
        ``spill``): its ``w|`` record is written as a waiter's, memory holds a count. A replay of
        it writes the same record again."""
        f = self.inflight[key]
        self._set(self.inflight, key, InFlight(f.holder, f.attempt, f.near_hash, f.near_space, f.waiters, f.spilled + 1))
        self._put_waiter(key, offset, req)

    def spilled_waiters(self, key: str, changelog: dict[bytes, bytes]) -> list[RequestEvent]:
        """The waiting copies of ``key`` not held in memory: its ``w|`` records in ``changelog`` (a
        read of the partition's changelog, latest value per key) and in the changes not yet
        written, less those removed since (the in-memory waiters a settlement just answered),
        oldest first; each gets its tombstone (call after :meth:`settle` said ``spilled``)."""
        prefix = f"w|{key}|".encode()
        records = {k: v for k, v in changelog.items() if k.startswith(prefix)}
        records.update({k: v for k, v in self.pending.items() if k.startswith(prefix)})
        found = sorted(((int(d["offset"]), RequestEvent.model_validate(d["request"]))
                        for d in (orjson.loads(v) for v in records.values() if v is not None)), key=lambda t: t[0])
        for _, w in found:
            self._drop_waiter(key, w)
        return [w for _, w in found]

    def settle(self, ev: SettledEvent) -> Settlement:
        """Apply a settlement from the sink; returns what to send (see :class:`Settlement`).

        * ``ok`` (from the holder or from any other computation of the key: the result is the
          key's): every waiter is answered from it; a cacheable result is kept as settled.
        * A retryable error (:data:`~schemas.errors.RETRYABLE_CODES`) of the holder with attempts
          left and waiters: the first waiter becomes the holder, attempt + 1.
        * Any other error of the holder: shared with every waiter.
        * An error of another request: nothing (the holder settles the key itself), except
          ``missing_object`` on a settled key: its document is gone, so the pointer goes.
        """
        key = ev.cache_key
        f = self.inflight.get(key)
        out = Settlement()
        if ev.status == "ok":
            if ev.cacheable and ev.result_uri:
                out.settled = Settled(ev.result_uri, ev.settled_at_ms, ev.engine, ev.model, ev.model_revision)
                self._put_settled(key, out.settled)
            if f is None:
                return out
            out.answered = [w for _, w in f.waiters]
            if not out.settled and ev.result_uri:  # another generation's output: answer from it, keep nothing
                out.settled = Settled(ev.result_uri, ev.settled_at_ms, ev.engine, ev.model, ev.model_revision)
            if f.holder is not None and f.near_hash is not None and not ev.near and ev.cacheable:
                out.index = (f.near_space or "", f.near_hash, f.holder.content_sha256)
            out.spilled = f.spilled
            self._end(key, f)
            return out
        code = ev.error.code if ev.error else ErrorCode.INTERNAL_ERROR
        if f is None or f.holder is None or f.holder.request_id != ev.request_id:
            if f is None and code == ErrorCode.MISSING_OBJECT and key in self.settled:
                self._evict(key)
            return out
        if code in RETRYABLE_CODES and ev.attempt < self.max_attempts and f.waiters:
            (_, first), rest = f.waiters[0], f.waiters[1:]
            self._del(self.ids, f.holder.request_id)
            self._drop_waiter(key, first)
            self._put_head(key, InFlight(first, ev.attempt + 1, f.near_hash, f.near_space, rest, f.spilled))
            out.promoted, out.attempt = first, ev.attempt + 1
            return out
        out.answered = [w for _, w in f.waiters]
        out.error = ev.error or ErrorInfo(code=code, message="the computation of this image failed")
        out.spilled = f.spilled
        self._end(key, f)
        return out

    def promote_unheld(self, key: str) -> RequestEvent | None:
        """For waiters restored without a holder record: the first becomes the holder (returned,
        for the caller to send to inference); None if the key has a holder or is gone."""
        f = self.inflight.get(key)
        if f is None or f.holder is not None or not f.waiters:
            return None
        (_, first), rest = f.waiters[0], f.waiters[1:]
        self._drop_waiter(key, first)
        self._put_head(key, InFlight(first, 1, None, None, rest, f.spilled))
        return first

    def unheld(self) -> list[str]:
        """Keys whose waiters were restored without their holder (a crash part-way through a
        changelog write): the caller answers them from ``settled`` or promotes one."""
        return [k for k, f in self.inflight.items() if f.holder is None]

    def answer_unheld(self, key: str) -> tuple[list[RequestEvent], int]:
        """End an unheld key whose result is settled: its waiters held in memory, to be answered
        from it, and how many wait in the changelog only (:meth:`spilled_waiters`)."""
        f = self.inflight.get(key)
        if f is None or f.holder is not None:
            return [], 0
        self._end(key, f)
        return [w for _, w in f.waiters], f.spilled

    def forget_settled(self, key: str) -> None:
        """Drop ``key``'s settled pointer (its generation was purged since)."""
        if key in self.settled:
            self._evict(key)

    def expire(self, now_ms: int) -> int:
        """Evict the settled keys older than the window (tombstones for the changelog); returns how many."""
        n = 0
        while self.settled:
            key, s = next(iter(self.settled.items()))
            if now_ms - s.at_ms <= self.settled_window_ms:
                break
            self._evict(key)
            n += 1
        return n

    # -- restore ----------------------------------------------------------------------------
    def restore(self, records: dict[bytes, bytes]) -> tuple[int, int, int]:
        """Rebuild from the changelog's latest value per key (tombstones already applied).

        Returns:
            ``(keys in flight, waiters, settled keys)`` restored.
        """
        heads: dict[str, dict] = {}
        waiters: dict[str, list[tuple[int, dict]]] = {}  # parsed into RequestEvents only for those held
        settled: list[tuple[str, Settled]] = []
        for k, v in records.items():
            d = orjson.loads(v)
            if k.startswith(b"f|"):
                heads[d["key"]] = d
            elif k.startswith(b"w|"):
                waiters.setdefault(d["key"], []).append((int(d["offset"]), d["request"]))
            elif k.startswith(b"s|"):
                settled.append((d["key"], Settled(d["result_uri"], int(d["at_ms"]), d.get("engine"), d.get("model"),
                                                  d.get("model_revision"))))
        for key, d in heads.items():
            holder = RequestEvent.model_validate(d["holder"])
            self.inflight[key] = InFlight(holder, int(d["attempt"]), d.get("near_hash"), d.get("near_space"))
            self.ids[holder.request_id] = key
        for key, ws in waiters.items():
            ws.sort(key=lambda t: t[0])
            held = [(o, RequestEvent.model_validate(r)) for o, r in ws[:self.max_waiters]]
            spilled = len(ws) - len(held)  # the rest stay in the changelog only
            f = self.inflight.get(key) or InFlight(None)
            self.inflight[key] = InFlight(f.holder, f.attempt, f.near_hash, f.near_space, tuple(held), spilled)
            for _, w in held:
                self.ids[w.request_id] = key
        for key, s in sorted(settled, key=lambda t: t[1].at_ms):
            self.settled[key] = s
        return (len(self.inflight), sum(len(f.waiters) + f.spilled for f in self.inflight.values()),
                len(self.settled))
