"""Reading and waiting: ``GET /v1/ocr/{request_id}`` (with its long-poll) and ``GET /v1/events``.

A request's state comes from MariaDB (finished: its result row), else Redis (the accepted marker),
else MariaDB's claims (an id chosen at either door). A waiter is registered in the completion hub
*before* the stores are read, so a completion that lands in between is not missed. With API keys
on, a key sees its own requests only: another key's request answers as if it did not exist.
"""

from __future__ import annotations

import asyncio
import time

import orjson

from schemas.errors import ErrorCode, HttpErrorCode
from schemas.events import CompletedEvent, ResultDocument
from services.api.clients import Clients
from services.api.errors import ApiError
from services.api.sse import EventStream, Watch, progress
from services.api.protocol import OcrResponse, finished
from services.api.serving_keys import Principal
from services.common.requests import claims
from services.common.cache.entries import CacheUnavailable
from services.common.errors import is_transient

#: What a request id is to a caller: the finished document, True (pending, or unknowable: Redis
#: down), False (unknown), None (another API key's).
Known = ResultDocument | bool | None


def owns(principal: Principal, key_id: str | None) -> bool:
    """Whether the caller may see a request made with API key ``key_id`` (keys off: all)."""
    return principal.key_id is None or key_id == principal.key_id


class ReadService:
    """The state of requests, now or when they finish.

    Args:
        clients: The door's clients (MariaDB, Redis, the completion hub, counters).
    """

    def __init__(self, clients: Clients):
        self.c = clients

    def done(self, doc: ResultDocument) -> OcrResponse:
        """The answer for a finished request."""
        return finished(doc, self.c.links(doc.request_id))

    def pending(self, rid: str) -> OcrResponse:
        """The answer for a request not finished yet."""
        return OcrResponse(request_id=rid, status="pending", links=self.c.links(rid))

    async def known(self, rid: str, principal: Principal) -> Known:
        """What ``rid`` is to the caller (:data:`Known`; submit answers another key's id 409, read 404).

        Raises:
            pymysql.MySQLError | OSError: MariaDB did not answer.
        """
        return (await self.known_many([rid], principal))[rid]

    async def known_many(self, rids: list[str], principal: Principal) -> dict[str, Known]:
        """:meth:`known` of many ids in three round trips whatever their number (64 concurrent calls
        could not keep under the Redis time budget on a cold connection pool): one MariaDB query for
        the finished; one Redis ``MGET`` of the others' accepted markers (Redis down: each is True,
        unknowable); one MariaDB query of the claims of those Redis does not know (chosen at the
        Kafka door, or the marker lost: :mod:`services.common.requests.claims`).

        Raises:
            pymysql.MySQLError | OSError: MariaDB did not answer.
            orjson.JSONDecodeError: a Redis marker is not JSON (not one the door wrote).
        """
        docs = await self.c.rows.get_requests(rids)
        rest = [rid for rid in rids if rid not in docs]
        known: dict[str, Known] = {}
        try:
            markers = dict(zip(rest, await self.c.cache.accepted_many(rest)))
        except CacheUnavailable:
            markers = {}
            known.update(dict.fromkeys(rest, True))  # unknowable: may exist
        for rid, raw in markers.items():
            if raw is not None:
                known[rid] = True if owns(principal, orjson.loads(raw).get("key")) else None
        unmarked = [rid for rid, raw in markers.items() if raw is None]
        held = await claims.held_claims(self.c.db, unmarked)
        for rid in unmarked:
            claim = held.get(rid)
            known[rid] = False if claim is None else True if owns(principal, claim.api_key_id) else None
        known.update({rid: doc if owns(principal, doc.api_key_id) else None for rid, doc in docs.items()})
        return known

    # -- GET /v1/ocr/{request_id} -------------------------------------------------------------
    async def read(self, rid: str, wait: float, principal: Principal) -> OcrResponse:
        """The request's state, waiting up to ``wait`` seconds for its completion (a wait ends
        early, answering ``pending``, when the door is told to stop: :meth:`Clients.begin_close`).

        Raises:
            ApiError: 404 ``not_found`` (unknown id, or another key's request), 503
                ``overloaded`` (too many long-polls) or ``unavailable`` (MariaDB down).
        """
        fut = None
        if wait > 0:
            try:
                fut = self.c.hub.register(rid)
            except OverflowError as exc:
                raise ApiError(HttpErrorCode.OVERLOADED, str(exc), {"Retry-After": "1"}) from None
        try:
            try:
                known = await self.known(rid, principal)
            except Exception as exc:
                if not is_transient(exc):
                    raise  # a defect, not an outage: a 500 with its traceback in the log
                if fut is None:  # MariaDB down: only a wait can still answer
                    raise ApiError(HttpErrorCode.UNAVAILABLE, f"results store unavailable: {exc!r}") from None
                known = True
            if isinstance(known, ResultDocument):
                return self.done(known)
            if known is False or known is None:
                raise ApiError(HttpErrorCode.NOT_FOUND, f"no request {rid!r}")
            if fut is not None:
                return await self._wait(rid, fut, wait, principal)
            return self.pending(rid)
        finally:
            if fut is not None:
                self.c.hub.unregister(rid, fut)

    async def _wait(self, rid: str, fut: asyncio.Future, wait: float, principal: Principal) -> OcrResponse:
        if not self.c.closing.is_set():
            stop = asyncio.ensure_future(self.c.closing.wait())
            try:
                await asyncio.wait((fut, stop), timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            ev: CompletedEvent = fut.result()
            if owns(principal, ev.result.api_key_id):
                return self.done(ev.result)
        return self.pending(rid)

    async def read_route(self, request_id: str, wait: float, principal: Principal) -> OcrResponse:
        """:meth:`read` with the wait capped at ``http_wait_max_s``, timed by outcome."""
        started = time.perf_counter()
        res = await self.read(request_id, min(wait, self.c.s.http_wait_max_s), principal)
        self.c.http_seconds.labels("read", res.status).observe(time.perf_counter() - started)
        return res

    # -- GET /v1/events -----------------------------------------------------------------------
    async def events_route(self, ids: list[str], timeout: float, principal: Principal,
                           reconnect: bool) -> EventStream | None:
        """``GET /v1/events``: distinct ids (at most ``http_batch_max_files``), counted by outcome.

        Raises:
            ApiError: 400 ``invalid_request`` (too many ids), else as :meth:`open_events`.
        """
        s = self.c.s
        rids = list(dict.fromkeys(ids))
        if len(rids) > s.http_batch_max_files:
            self.c.http_requests.labels("events", "invalid_request").inc()
            raise ApiError(ErrorCode.INVALID_REQUEST, f"{len(rids)} request ids: a stream watches at most "
                           f"{s.http_batch_max_files} (OCRSTREAM_HTTP_BATCH_MAX_FILES)")
        try:
            stream = await self.open_events(rids, min(timeout, s.http_events_max_s), principal, reconnect)
        except ApiError as err:
            self.c.http_requests.labels("events", err.code).inc()
            raise
        self.c.http_requests.labels("events", "opened" if stream else "finished").inc()
        return stream

    async def open_events(self, rids: list[str], timeout_s: float, principal: Principal,
                          reconnect: bool) -> EventStream | None:
        """A server-sent event stream of these requests (``GET /v1/events``; :mod:`.events`).

        The hub waiters are registered *before* MariaDB and Redis are read, so a completion that
        lands in between is not missed (as in :meth:`read`). Ids unknown to the caller (no such
        request, or another key's) get an ``error`` event, or 404 when all are.

        Args:
            rids: Distinct request ids, in the order their first events are sent.
            timeout_s: Longest time the stream stays open, s (already capped).
            principal: The caller; sees only its own key's requests.
            reconnect: The client sent ``Last-Event-ID`` (an ``EventSource`` reconnecting).

        Returns:
            The stream; None (answered 204) for a reconnect when no id is pending any more: per
            the WHATWG spec, 204 tells an ``EventSource`` to stop reconnecting.

        Raises:
            ApiError: 503 ``overloaded`` (the ids do not fit under ``http_max_waiters``), 404
                ``not_found`` (no id is the caller's).
        """
        try:
            watch = Watch(self.c.hub, self.c.hub.register_many(rids))
        except OverflowError as exc:
            raise ApiError(HttpErrorCode.OVERLOADED, str(exc), {"Retry-After": "1"}) from None
        try:
            try:
                known = await self.known_many(rids, principal)
            except Exception as exc:
                if not is_transient(exc):
                    raise  # a defect, not an outage: a 500 with its traceback in the log
                known = {rid: True for rid in rids}  # MariaDB down: only the completions can still answer
            snapshot = [(rid, known[rid]) for rid in rids]
            if not any(isinstance(state, ResultDocument) or state is True for _, state in snapshot):
                raise ApiError(HttpErrorCode.NOT_FOUND, f"no request {rids[0]!r}" if len(rids) == 1
                               else f"none of the {len(rids)} requests exists")
            if reconnect and not any(state is True for _, state in snapshot):
                watch.close()
                return None
        except BaseException:
            watch.close()
            raise
        events = progress(
            watch, snapshot, timeout_s=timeout_s, keepalive_s=self.c.s.http_events_keepalive_s,
            completed=lambda doc: self.done(doc).model_dump_json(by_alias=True).encode(),
            pending=lambda rid: self.pending(rid).model_dump_json(by_alias=True).encode(),
            owned=lambda doc: owns(principal, doc.api_key_id), closing=self.c.closing)
        self.c.http_streams.inc()

        def closed() -> None:
            watch.close()
            self.c.http_streams.dec()

        return EventStream(events, closed)
