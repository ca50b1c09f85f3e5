"""What a handler is handed: a consumed Kafka record, decoded (:class:`Record`), and the consumer
span the runner opened for it.

The runner (:mod:`services.common.runner`) turns every fetched record into a :class:`Record` with
:class:`RecordParser`: the value is parsed into the event model the handler declared for its topic
(:meth:`services.common.handler.Handler.consumes`); a value that does not parse keeps ``value``
None and the parse error in ``error``, and goes to :meth:`Handler.undecodable` instead of
:meth:`Handler.handle`. Each time a batch is handed to the handler, every record gets a fresh
:class:`RecordSpan`: a ``CONSUMER`` span named after the stage, continuing the trace of the
record's ``traceparent`` header, started when the handler first uses it and ended by
:meth:`Record.traced` on exit, or by the runner when the handler's call returns or fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from opentelemetry import trace
from pydantic import BaseModel

from services.common.codec import loads
from services.common.telemetry import Span, SpanKind, StatusCode, Telemetry, record_attrs

E = TypeVar("E")

Headers = tuple[tuple[str, bytes], ...]


class RecordSpan:
    """The consumer span of one record for one hand-over to the handler, started on first use.

    Args:
        start: Starts the span (not activated); called at most once.
    """

    def __init__(self, start: Callable[[], Span]):
        self._start = start
        self._span: Span | None = None
        self._ended = False

    @property
    def span(self) -> Span:
        """The span, started now if it was not yet."""
        if self._span is None:
            self._span = self._start()
        return self._span

    @property
    def started(self) -> bool:
        """Whether the span was started (a handler used it)."""
        return self._span is not None

    def end(self, exc: BaseException | None = None) -> None:
        """End the span if it was started and is not ended yet; ``exc`` (the handler's call failed
        while the span was open) is recorded on it and sets its status to error. Idempotent."""
        if self._span is None or self._ended:
            return
        self._ended = True
        if exc is not None:
            self._span.record_exception(exc)
            self._span.set_status(StatusCode.ERROR, type(exc).__name__)
        self._span.end()


@dataclass(frozen=True, eq=False)
class Record(Generic[E]):
    """One consumed record, decoded.

    Attributes:
        topic: The topic it was read from.
        partition: Its partition.
        offset: Its offset in the partition.
        timestamp_ms: Its Kafka timestamp (the producer's create time, or the broker's append time
            under ``LogAppendTime``), epoch ms.
        key: Its key as text (UTF-8, undecodable bytes replaced), or None.
        headers: Its Kafka headers, ``(name, bytes)`` pairs in order (``traceparent`` among them).
        value: The decoded event (an instance of the model the handler declared for ``topic``);
            the raw bytes for a topic the handler declared no model for; None when the value did
            not decode (``error`` says why).
        raw: The value's bytes as consumed (None for a tombstone).
        raw_key: The key's bytes as consumed.
        error: Why ``value`` did not decode (``orjson.JSONDecodeError``, ``pydantic.ValidationError``,
            ``ValueError`` for a missing value), else None.
        trace: The consumer span the runner opened for this hand-over (None outside the runner:
            a prefetched record, a unit test).
    """

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: str | None
    headers: Headers
    value: E | None
    raw: bytes | None
    raw_key: bytes | None = None
    error: Exception | None = None
    trace: RecordSpan | None = field(default=None, repr=False)

    @property
    def size_bytes(self) -> int:
        """The value's size as consumed, bytes (0 for a tombstone)."""
        return len(self.raw or b"")

    def queue_wait_ms(self) -> float:
        """How long the record waited before this call: now minus its timestamp, ms (>= 0)."""
        return max(0.0, time.time() * 1000 - self.timestamp_ms)

    @property
    def span(self) -> Span | None:
        """The record's consumer span (started now if the handler had not used it yet), or None
        outside the runner."""
        return self.trace.span if self.trace is not None else None

    @contextmanager
    def traced(self) -> Iterator[Span | None]:
        """Make the record's span current for the block (its stage's work on the record: store
        calls, log lines and :meth:`trace_headers` inside are of the record's trace), and end it on
        exit; an exception escaping the block is recorded on it. Enter it once, around the work of
        this record alone. Outside the runner (no span) the block runs as it is."""
        if self.trace is None:
            yield None
            return
        sp = self.trace.span
        try:
            with trace.use_span(sp, end_on_exit=False, record_exception=True, set_status_on_exception=True):
                yield sp
        finally:
            self.trace.end()

    def trace_headers(self) -> list[tuple[str, bytes]]:
        """Headers for a message this record causes: the record's own, with its span's
        ``traceparent`` in place of the one it came with (the current span's outside the runner)."""
        return Telemetry.inject(self.headers, span=self.span)

    def traceparent(self) -> str | None:
        """The W3C ``traceparent`` of the record's span (the current span's outside the runner), or
        None without one."""
        return Telemetry.traceparent(self.span)

    def with_span(self, telemetry: Telemetry, name: str) -> "Record[E]":
        """This record with a fresh consumer span ``name`` (not started yet): parent from its
        ``traceparent`` header (none: a new trace), attributes naming ``topic[partition]@offset``."""
        attrs = record_attrs(self)

        def start() -> Span:
            return telemetry.start_span(name, parent_headers=self.headers, kind=SpanKind.CONSUMER, attributes=attrs)

        return replace(self, trace=RecordSpan(start))


class RecordParser:
    """Turns consumed records into :class:`Record` values, parsing each value by its topic.

    Args:
        models: Topic -> the event model its values are parsed into
            (:func:`services.common.codec.loads`); a topic not named keeps its bytes as ``value``.
    """

    def __init__(self, models: Mapping[str, type[BaseModel]]):
        self.models = dict(models)

    def __call__(self, rec: Any) -> Record:
        """The :class:`Record` of ``rec``, a consumed record with aiokafka's ``ConsumerRecord``
        fields (topic, partition, offset, timestamp, key, value, headers). Never raises: a value
        that does not parse is kept in ``raw`` with the error in ``error``."""
        model = self.models.get(rec.topic)
        value: Any = rec.value
        error: Exception | None = None
        if model is not None:
            try:
                value = loads(model, rec.value)
            except Exception as exc:  # noqa: BLE001 - any parse failure is the record's own
                value, error = None, exc
        key = rec.key.decode(errors="replace") if isinstance(rec.key, bytes) else rec.key
        return Record(topic=rec.topic, partition=rec.partition, offset=rec.offset, timestamp_ms=rec.timestamp,
                      key=key, headers=tuple(rec.headers or ()), value=value, raw=rec.value, raw_key=rec.key,
                      error=error)
