"""Server-sent events of the HTTP door: the progress of many requests on one connection.

The wire format is the WHATWG HTML Living Standard, §9.2 "Server-sent events"
(https://html.spec.whatwg.org/multipage/server-sent-events.html): a ``text/event-stream`` body in
UTF-8, each event a block of ``field: value`` lines (``event``, ``id``, ``data``) ended by a blank
line, and lines starting with ``:`` as comments (used here as keep-alives). Every ``data`` value
written here is one line of compact JSON, so an event never needs more than one ``data`` line.

This module holds the transport (:func:`encode`, :class:`EventStream`) and the event sequence
(:func:`progress`); the door's admission checks (keys, ownership, limits) are in
:meth:`services.api.serving_read.ReadService.open_events`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable

import orjson
from starlette.responses import Response

from schemas.events import CompletedEvent, ResultDocument

log = logging.getLogger(__name__)

#: Ids an event stream accepts: those a request can have (server ids are 32 hex digits; a client's
#: own ``request_id`` follows the submit pattern). No CR, LF or NUL can reach an ``id:`` field.
ID_PATTERN = r"^[A-Za-z0-9._:-]{1,64}$"
_ID_RE = re.compile(ID_PATTERN)
#: A comment line: ignored by clients, keeps proxies and load balancers from closing an idle stream.
KEEPALIVE = b": keep-alive\n\n"
MEDIA_TYPE = "text/event-stream"


def encode(event: str, data: object, event_id: str | None = None) -> bytes:
    """One event as ``text/event-stream`` bytes.

    Args:
        event: The event type (``event:`` field), e.g. ``completed``.
        data: Serialised with orjson to one line of JSON (``data:`` field); bytes are taken as
            JSON already and must not contain a line break.
        event_id: The ``id:`` field (the client's last event ID); must match :data:`ID_PATTERN`.

    Returns:
        ``event: E\\nid: I\\ndata: {...}\\n\\n`` (``id`` only when given).

    Raises:
        ValueError: an id or data that would break the framing (a line break or NUL).
    """
    body = data if isinstance(data, bytes) else orjson.dumps(data)
    if b"\n" in body or b"\r" in body:
        raise ValueError("event data must be one line")
    head = f"event: {event}\n"
    if event_id is not None:
        if not _ID_RE.fullmatch(event_id):  # not match: "$" also matches before a final "\n"
            raise ValueError(f"event id {event_id!r} does not match {ID_PATTERN}")
        head += f"id: {event_id}\n"
    return head.encode() + b"data: " + body + b"\n\n"


class Watch:
    """The hub waiters one stream holds: one future per request still pending.

    Args:
        hub: The door's :class:`~services.api.hub.CompletionHub`.
        futures: ``{request_id: future}`` from ``hub.register_many``.
    """

    def __init__(self, hub, futures: dict[str, asyncio.Future]):
        self.hub = hub
        self.futures = dict(futures)

    def drop(self, rid: str) -> None:
        """Release the waiter of ``rid`` (no-op when already released)."""
        fut = self.futures.pop(rid, None)
        if fut is not None:
            self.hub.unregister(rid, fut)

    def close(self) -> None:
        """Release every waiter still held (idempotent): the stream ended or its client left."""
        for rid in list(self.futures):
            self.drop(rid)


async def progress(watch: Watch, snapshot: list[tuple[str, ResultDocument | bool | None]], *,
                   completed: Callable[[ResultDocument], bytes], pending: Callable[[str], bytes],
                   owned: Callable[[ResultDocument], bool], timeout_s: float,
                   keepalive_s: float, closing: asyncio.Event | None = None) -> AsyncIterator[bytes]:
    """The events of one stream, as ``text/event-stream`` chunks.

    First one event per id, in the order asked: ``completed`` (already finished), ``pending``,
    or ``error`` (``not_found``: unknown, or another key's). Then one ``completed`` per request
    as its completion arrives on ``ocr.completed``, a keep-alive comment after every
    ``keepalive_s`` seconds without an event, and last ``end`` once nothing is pending or after
    ``timeout_s`` seconds. If the hub stops or ``closing`` is set (the door is shutting down) the
    stream ends without ``end``, so an ``EventSource`` reconnects (to another replica).

    Args:
        watch: The stream's waiters, registered *before* ``snapshot`` was read; released here as
            requests finish and by :meth:`Watch.close` at the end.
        snapshot: ``(request_id, state)`` per id: the finished document, True if pending, False
            or None if not found.
        completed: The ``data`` of a finished request (``GET /v1/ocr/{id}``'s JSON body).
        pending: The ``data`` of a pending request.
        owned: Whether a completion's document belongs to the caller (its API key).
        timeout_s: Longest time the stream stays open after its first events, s.
        keepalive_s: Longest silence before a keep-alive comment, s.
        closing: Set when the door is told to stop (SIGTERM).
    """
    loop = asyncio.get_running_loop()
    done: list[str] = []
    missing: list[str] = []
    waiting: dict[asyncio.Future, str] = {}
    order = {rid: i for i, (rid, _) in enumerate(snapshot)}
    stop = asyncio.ensure_future(closing.wait()) if closing is not None else None
    try:
        for rid, state in snapshot:
            if isinstance(state, ResultDocument):
                watch.drop(rid)
                done.append(rid)
                yield encode("completed", completed(state), rid)
            elif state is True:
                waiting[watch.futures[rid]] = rid
                yield encode("pending", pending(rid), rid)
            else:
                watch.drop(rid)
                missing.append(rid)
                yield encode("error", _not_found(rid), rid)
        deadline = loop.time() + timeout_s
        while waiting:
            left = deadline - loop.time()
            if left <= 0:
                break
            ready, _ = await asyncio.wait([*waiting, *([stop] if stop is not None else [])],
                                          timeout=min(left, keepalive_s), return_when=asyncio.FIRST_COMPLETED)
            if stop is not None and stop in ready:  # the door is going away
                return
            if not ready:
                yield KEEPALIVE
                continue
            for fut in sorted(ready, key=lambda f: order[waiting[f]]):  # together: in the order asked
                rid = waiting.pop(fut)
                watch.drop(rid)
                if fut.cancelled():  # the hub stopped: the door is going away
                    return
                ev: CompletedEvent = fut.result()
                if owned(ev.result):
                    done.append(rid)
                    yield encode("completed", completed(ev.result), rid)
                else:  # pending only because Redis could not tell: another key's request
                    missing.append(rid)
                    yield encode("error", _not_found(rid), rid)
        still = set(waiting.values())
        yield encode("end", {"reason": "timeout" if still else "done", "completed": done,
                             "pending": [rid for rid, _ in snapshot if rid in still], "not_found": missing})
    finally:
        if stop is not None:
            stop.cancel()
        watch.close()


def _not_found(rid: str) -> dict:
    return {"request_id": rid, "error": {"code": "not_found", "message": f"no request {rid!r}"}}


class EventStream(Response):
    """An ASGI response streaming ``text/event-stream`` until the events end or the client leaves.

    The client's disconnect is watched on ``receive`` (``http.disconnect``) while the events are
    sent, so a stream waiting for a completion notices at once, not at its next write; either
    way ``on_close`` runs (it releases the stream's hub waiters).

    Args:
        events: The chunks to send (:func:`progress`).
        on_close: Called exactly once when the stream ends, however it ends.
        headers: Extra response headers.
    """

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None):
        super().__init__(status_code=200)
        self.events = events
        self.on_close = on_close
        self.stream_headers = {"content-type": MEDIA_TYPE, "cache-control": "no-store",
                               "x-accel-buffering": "no", **(headers or {})}

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.stream_headers.items()]})
            pump = asyncio.ensure_future(self._pump(send))
            gone = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pump, gone):
                    task.cancel()
                results = await asyncio.gather(pump, gone, return_exceptions=True)
            err = results[0]
            if isinstance(err, BaseException) and not isinstance(err, (asyncio.CancelledError, OSError)):
                raise err
        finally:
            try:
                await self.events.aclose()
            finally:
                self.on_close()

    async def _pump(self, send) -> None:
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive) -> None:
    """Returns once the client has gone (ASGI ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass
