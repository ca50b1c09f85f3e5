"""Metrics (prometheus-client), tracing (OpenTelemetry) and the health/metrics HTTP endpoint.

The runner and the clients report here; handlers stay free of metric calls except for
domain events (cache hits, engine batches) through the same object.

Tracing: one trace per request. The submitter (or ingest, when a submission carries no
``traceparent``) starts it; every stage continues it from the record's ``traceparent`` Kafka
header: the runner opens each record's consumer span (:meth:`services.common.records.Record.traced`,
:meth:`Telemetry.start_span` with ``parent_headers``), store calls open child spans
(:meth:`Telemetry.store_call`), the runner opens one ``publish`` span per produced message and
re-injects it. Work done for many requests at once (an engine batch, a batched MySQL write) is
one span in a trace of its own with a :class:`~opentelemetry.trace.Link` to every request.

With ``traces_exporter=none`` the provider samples nothing (``ALWAYS_OFF``) and has no span
processor: every span is a ``NonRecordingSpan`` that still gets fresh ids, which propagate
(the result's ``trace_id``, log lines; ``traceparent`` with the sampled flag off), nothing is
recorded or exported, so the cost is one small object per span. Any exporter samples everything.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager

import orjson
from aiokafka import TopicPartition
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON
from opentelemetry.trace import Link, Span, SpanKind, StatusCode  # noqa: F401 (re-exported for handlers)
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from services.common.settings import TelemetrySettings

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _ProducerRenewals:
    """A Prometheus collector: each watched producer's ``renewals``, read at scrape time."""

    def __init__(self, producers: list):
        self.producers = producers

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("ocrstream_producer_renewals", "Kafka producers replaced by a fresh one after "
                                     "the broker refused their sequence numbers", labels=["producer"])
        for p in self.producers:
            family.add_metric([p.name], p.renewals)
        yield family


class Telemetry:
    """One per process. Holds the Prometheus registry and the tracer.

    Args:
        service: Stage name, used as the ``stage`` label and the OpenTelemetry service name.
        cfg: Telemetry settings.
    """

    def __init__(self, service: str, cfg: TelemetrySettings):
        self.service = service
        self.cfg = cfg
        self.registry = CollectorRegistry()
        self._pixel_gauges: tuple[Gauge, Gauge] | None = None
        r = self.registry
        self.messages_in = Counter("ocrstream_messages_in", "Records consumed", ["stage", "topic"], registry=r)
        self.messages_out = Counter("ocrstream_messages_out", "Records produced and acknowledged", ["stage", "topic"], registry=r)
        self.requests_done = Counter("ocrstream_requests", "Requests finished by status/error code", ["stage", "status", "code"], registry=r)
        self.poisoned = Counter("ocrstream_poison_messages", "Records sent to the DLQ", ["stage"], registry=r)
        self.dep_retries = Counter("ocrstream_dependency_retries", "Retries while a dependency was down", ["stage", "error"], registry=r)
        self.commits = Counter("ocrstream_commits", "Offset commits", ["stage"], registry=r)
        self.revoked_records = Counter("ocrstream_revoked_records",
                                       "Records of revoked partitions the runner held: in_flight (handled, never committed) "
                                       "or carried (fetched, dropped unhandled)", ["stage", "held"], registry=r)
        self.cache = Counter("ocrstream_cache", "Cache lookups by outcome (hit, miss, joined, promoted, error)", ["stage", "outcome", "tier"], registry=r)
        self.batch_size = Histogram("ocrstream_batch_size", "Records per batch", ["stage"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.batch_seconds = Histogram("ocrstream_batch_seconds", "Batch wall time", ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.engine_images = Counter("ocrstream_engine_images", "Requests (images) run through the OCR engine", ["engine"], registry=r)
        self.store_seconds = Histogram("ocrstream_store_call_seconds", "S3/Redis/MySQL call latency", ["store", "op"], buckets=_LATENCY_BUCKETS, registry=r)
        self.errors = Counter("ocrstream_errors", "Records given up on (DLQ) by error code", ["stage", "code"], registry=r)
        self.engine_seconds = Histogram("ocrstream_engine_seconds", "Engine wall time per request (all its pages and tiles, "
                                        "engine slot waits included)", ["engine"], buckets=_LATENCY_BUCKETS, registry=r)
        self.window_in_flight = Gauge("ocrstream_window_in_flight", "Records in the window now (being fetched, decoded "
                                      "or on the engine), by lane", ["stage", "lane"], registry=r)
        self.window_waiting = Gauge("ocrstream_window_waiting", "Records fetched and waiting for a window slot, by lane",
                                    ["stage", "lane"], registry=r)
        self.window_slots = Gauge("ocrstream_window_slots", "The window's size (max_in_flight) and its interactive "
                                  "reserve", ["stage", "kind"], registry=r)
        self.lane_wait = Histogram("ocrstream_lane_queue_wait_seconds", "From a record's Kafka timestamp to its start in "
                                   "the window, by lane", ["stage", "lane"], buckets=_LATENCY_BUCKETS, registry=r)
        self.consumer_lag = Gauge("ocrstream_consumer_lag", "Records behind the partition end (highwater - position)", ["stage", "topic", "partition"], registry=r)
        self.state_size = Gauge("ocrstream_dedup_state", "Dedup's keyed state now: keys in flight, waiting copies, "
                                "settled keys", ["kind"], registry=r)
        self.state_restored = Counter("ocrstream_dedup_restored", "Dedup state restored from the changelog on "
                                      "assignment: keys in flight, waiting copies, settled keys", ["kind"], registry=r)
        self.probe_up = Gauge("ocrstream_dependency_up", "1 when the last readiness check of a dependency passed", ["stage", "dependency"], registry=r)
        self.ready_checks: list[Callable[[], bool]] = []
        self.live_checks: dict[str, Callable[[], bool]] = {}  # name -> False once the process cannot recover
        self._probes: dict[str, bool | None] = {}
        self._optional: set[str] = set()  # probes readiness does not wait for
        self._probe_tasks: list[asyncio.Task] = []
        self._lag_tps: set[TopicPartition] = set()
        self._producers: list = []  # RenewingProducers whose renewals are exported (watch_producer)
        self.tracer = self._setup_tracing()

    # -- tracing ------------------------------------------------------------------------
    def _setup_tracing(self) -> trace.Tracer:
        # "none": spans are not sampled, so not recorded at all (ids are still made and propagate)
        sampler = ALWAYS_OFF if self.cfg.traces_exporter == "none" else ALWAYS_ON
        provider = TracerProvider(sampler=sampler, resource=Resource.create({"service.name": f"ocrstream-{self.service}"}))
        exporter: SpanExporter | None = None
        if self.cfg.traces_exporter == "console":
            exporter = ConsoleSpanExporter()
        elif self.cfg.traces_exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # extra `otlp`

            exporter = OTLPSpanExporter(endpoint=self.cfg.otlp_endpoint)
        elif self.cfg.traces_exporter == "file":
            if not self.cfg.traces_file:
                raise ValueError("traces_exporter=file needs OCRSTREAM_TELEMETRY__TRACES_FILE")
            exporter = JsonLinesSpanExporter(self.cfg.traces_file)
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self.provider = provider
        global _GLOBAL_SET
        if not _GLOBAL_SET:  # module-level helpers (``traced``) use the global provider
            trace.set_tracer_provider(provider)
            _GLOBAL_SET = True
        return provider.get_tracer("ocrstream")

    @staticmethod
    def extract(headers: Sequence[tuple[str, bytes]] | None):
        """OpenTelemetry context from Kafka headers (W3C ``traceparent``)."""
        carrier = {k: v.decode("latin-1") for k, v in (headers or []) if k in ("traceparent", "tracestate")}
        return propagate.extract(carrier)

    @staticmethod
    def inject(headers: Sequence[tuple[str, bytes]] | None = None, span: Span | None = None) -> list[tuple[str, bytes]]:
        """Kafka headers carrying the context of ``span`` (default: the current span) as ``traceparent``.

        Other headers are kept; an older ``traceparent``/``tracestate`` is replaced.
        """
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
        out = [h for h in (headers or []) if h[0] not in ("traceparent", "tracestate")]
        out.extend((k, v.encode("latin-1")) for k, v in carrier.items())
        return out

    @staticmethod
    def traceparent(span: Span | None = None) -> str | None:
        """The W3C ``traceparent`` of ``span`` (default: the current span), or None without one."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
        return carrier.get("traceparent")

    @staticmethod
    def current_span() -> Span:
        """The current span (an invalid one outside any trace)."""
        return trace.get_current_span()

    @staticmethod
    def trace_id(span: Span | None = None) -> str | None:
        """32 hex digits of the trace id of ``span`` (default: the current span), or None."""
        ctx = (span or trace.get_current_span()).get_span_context()
        return format(ctx.trace_id, "032x") if ctx.is_valid else None

    @staticmethod
    def trace_id_of(traceparent: str | None) -> str | None:
        """The trace id inside a W3C ``traceparent`` string (``00-<trace>-<span>-<flags>``)."""
        parts = (traceparent or "").split("-")
        return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None

    def start_span(
        self,
        name: str,
        *,
        parent_headers: Sequence[tuple[str, bytes]] | None = None,
        traceparent: str | None = None,
        links: Sequence[Link] | None = None,
        attributes: dict | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        root: bool = False,
    ) -> Span:
        """Start (not activate) a span; end it with ``span.end()``.

        The parent is, in order: ``traceparent``, ``parent_headers`` (a record's headers;
        without a ``traceparent`` there the span starts a new trace), nothing when ``root``,
        else the current span.
        """
        if traceparent is not None:
            ctx = propagate.extract({"traceparent": traceparent})
        elif parent_headers is not None:
            ctx = self.extract(parent_headers)
        elif root:
            ctx = otel_context.Context()
        else:
            ctx = None
        return self.tracer.start_span(name, context=ctx, kind=kind, links=links, attributes=attributes)

    @contextmanager
    def span(self, name: str, **kw) -> Iterator[Span]:
        """Start a span (see :meth:`start_span` for the parent) and make it current for the block.

        An exception escaping the block is recorded on the span and sets its status to error.
        """
        sp = self.start_span(name, **kw)
        with trace.use_span(sp, end_on_exit=True, record_exception=True, set_status_on_exception=True):
            yield sp

    @staticmethod
    @contextmanager
    def use(span: Span | None) -> Iterator[None]:
        """Make ``span`` (already started, possibly ended) current for the block, without ending it."""
        if span is None:
            yield
            return
        with trace.use_span(span, end_on_exit=False):
            yield

    @staticmethod
    def link(span: Span | None) -> list[Link]:
        """A one-element list linking to ``span`` (empty for None or an invalid span)."""
        if span is None or not span.get_span_context().is_valid:
            return []
        return [Link(span.get_span_context())]

    @contextmanager
    def store_call(self, store: str, op: str, **attributes) -> Iterator[None]:
        """Time one S3/Redis/MySQL call into ``ocrstream_store_call_seconds`` and, inside a
        recorded request's trace, open a client span ``<store>.<op>`` (no orphan traces for calls
        made outside any request, e.g. housekeeping).

        Under an unsampled parent (``traces_exporter=none``: every span is ``ALWAYS_OFF``) no child
        span is opened: it would be recorded nowhere, and nothing inside a store call reads the
        current span (no client propagates trace context to Redis, MariaDB or S3), so the only
        thing it cost was ~15 µs of CPU per call (measured with a non-recording parent: 18 µs per
        call with the span, of which the metric is ~3 µs; about 1.3 % of the HTTP door's CPU per
        cached answer, which makes one Redis call).
        """
        started = time.perf_counter()
        parent = trace.get_current_span()
        try:
            if parent.is_recording():
                with self.span(f"{store}.{op}", kind=SpanKind.CLIENT,
                               attributes={"db.system": store, "ocrstream.op": op, **attributes}):
                    yield
            else:
                yield
        finally:
            self.store_seconds.labels(store, op).observe(time.perf_counter() - started)

    # -- runner hooks -------------------------------------------------------------------
    def batch_in(self, stage: str, records: Sequence) -> None:
        """A batch of records (each with a ``topic``) was consumed."""
        for rec in records:
            self.messages_in.labels(stage, rec.topic).inc()
        self.batch_size.labels(stage).observe(len(records))

    def batch_done(self, stage: str, n: int, seconds: float) -> None:
        """A batch was handled, produced and committed in ``seconds``."""
        self.batch_seconds.labels(stage).observe(seconds)

    def message_out(self, stage: str, topic: str) -> None:
        """One produced record was acknowledged."""
        self.messages_out.labels(stage, topic).inc()

    def poison(self, stage: str, code: str = "internal_error") -> None:
        """A record was given up on and sent to the DLQ (``code``: its error code)."""
        self.poisoned.labels(stage).inc()
        self.errors.labels(stage, code).inc()

    def lag(self, stage: str, lags: dict[TopicPartition, int]) -> None:
        """Consumer lag per assigned partition; partitions no longer assigned are dropped."""
        for tp in self._lag_tps - set(lags):
            try:
                self.consumer_lag.remove(stage, tp.topic, str(tp.partition))
            except KeyError:
                pass
        for tp, n in lags.items():
            self.consumer_lag.labels(stage, tp.topic, str(tp.partition)).set(n)
        self._lag_tps = set(lags)

    def watch_pixel_budget(self, budget) -> None:
        """Export ``budget`` (a :class:`~services.common.images.decoding.PixelBudget`) as
        ``ocrstream_decoded_bytes`` (bytes of decoded pixels held now) and
        ``ocrstream_decoded_bytes_peak`` (the most held at once); a later call re-points them."""
        if self._pixel_gauges is None:
            self._pixel_gauges = (
                Gauge("ocrstream_decoded_bytes", "Bytes of decoded pixels held now (the pixel budget in use)",
                      registry=self.registry),
                Gauge("ocrstream_decoded_bytes_peak", "The most bytes of decoded pixels held at once since start",
                      registry=self.registry))
        self._pixel_gauges[0].set_function(lambda: budget.used)
        self._pixel_gauges[1].set_function(lambda: budget.peak)

    def watch_producer(self, producer) -> None:
        """Export how often ``producer`` (a :class:`~services.common.kafka.RenewingProducer`) was
        renewed as ``ocrstream_producer_renewals_total{producer}`` (label: its client id): the broker
        refused its sequence numbers (after a broker restart, or a refused batch), and a fresh
        producer took its place (``docs/delivery.md``, "Failures")."""
        if not self._producers:
            self.registry.register(_ProducerRenewals(self._producers))
        self._producers.append(producer)

    def engine_request(self, engine: str, seconds: float) -> None:
        """The engine read one request's pages in ``seconds`` (wall time)."""
        self.engine_images.labels(engine).inc()
        self.engine_seconds.labels(engine).observe(seconds)

    def watch_engine(self, engine) -> None:
        """Export ``engine`` (an :class:`~services.infer.engines.base.OcrEngine`) as
        ``ocrstream_engine_slots`` (pages it can work on at once) and ``ocrstream_engine_slots_busy``
        (pages on it now): an operator sees whether the GPU is kept full."""
        Gauge("ocrstream_engine_slots", "Pages the engine can work on at once", ["engine"],
              registry=self.registry).labels(engine.name).set_function(lambda: engine.slots)
        Gauge("ocrstream_engine_slots_busy", "Pages on the engine now", ["engine"],
              registry=self.registry).labels(engine.name).set_function(lambda: engine.busy)

    def produce_span(self, topic: str, headers: Sequence[tuple[str, bytes]] | None) -> tuple[Span | None, list[tuple[str, bytes]]]:
        """A ``<topic> publish`` producer span under the message's ``traceparent`` (None when it
        has none) and the headers re-injected with it. End it with :meth:`end_produce`."""
        hdrs = list(headers or [])
        if not any(k == "traceparent" for k, _ in hdrs):
            return None, hdrs
        sp = self.start_span(f"{topic} publish", parent_headers=hdrs, kind=SpanKind.PRODUCER,
                             attributes={"messaging.system": "kafka", "messaging.destination.name": topic})
        return sp, self.inject(hdrs, span=sp)

    @staticmethod
    def end_produce(span: Span | None, result: object) -> None:
        """End a publish span with the broker's answer (metadata or an exception)."""
        if span is None:
            return
        if isinstance(result, BaseException):
            span.record_exception(result)
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(result).__name__))
        else:
            span.set_attribute("messaging.kafka.partition", getattr(result, "partition", -1))
            span.set_attribute("messaging.kafka.offset", getattr(result, "offset", -1))
        span.end()

    # -- readiness probes -------------------------------------------------------------------
    def add_probe(self, name: str, check: Callable[[], Awaitable[object]], interval_s: float | None = None,
                  required: bool = True) -> None:
        """Check a dependency every ``interval_s`` in the background (never per request).

        ``/readyz`` fails until the check has passed and while its last run failed (returned
        falsy, raised or took longer than 3 s). With ``required`` False (a cache the stage works
        without: Redis for dedup and the sink) only ``ocrstream_dependency_up`` shows it, and
        readiness does not wait for it. Call from the running event loop.
        """
        interval = interval_s or self.cfg.probe_interval_s
        self._probes[name] = None

        async def loop() -> None:
            while True:
                try:
                    ok = bool(await asyncio.wait_for(check(), timeout=min(3.0, interval)))
                except Exception:
                    ok = False
                if ok != self._probes.get(name) and self._probes.get(name) is not None:
                    log.log(logging.INFO if ok else logging.WARNING, "%s: %s %s", self.service, name,
                            "reachable again" if ok else "unreachable: not ready")
                self._probes[name] = ok
                self.probe_up.labels(self.service, name).set(int(ok))
                await asyncio.sleep(interval)

        self._probe_tasks.append(asyncio.get_running_loop().create_task(loop()))
        if required:
            self.ready_checks.append(lambda: self._probes.get(name) is True)
        else:
            self._optional.add(name)

    def not_ready(self) -> list[str]:
        """Names of the required dependencies whose last check failed (or has not run yet)."""
        return [n for n, ok in self._probes.items() if ok is not True and n not in self._optional]

    def close(self) -> None:
        """Stop the probes and flush the span exporter."""
        for t in self._probe_tasks:
            t.cancel()
        self.provider.shutdown()

    def dependency_retry(self, stage: str, error: str) -> None:
        """A dependency was down; the stage backs off and retries."""
        self.dep_retries.labels(stage, error).inc()

    def commit(self, stage: str) -> None:
        """Offsets were committed."""
        self.commits.labels(stage).inc()

    def revoked(self, stage: str, in_flight: int, carried: int) -> None:
        """A rebalance took partitions away while the runner held ``in_flight`` records of them in the
        running batch (left uncommitted) and ``carried`` fetched ones (dropped)."""
        self.revoked_records.labels(stage, "in_flight").inc(in_flight)
        self.revoked_records.labels(stage, "carried").inc(carried)

    # -- HTTP: /metrics /healthz /readyz --------------------------------------------------
    async def serve(self, port: int, host: str = "0.0.0.0") -> asyncio.AbstractServer:
        """Serve ``/metrics`` (Prometheus text), ``/healthz`` (liveness: 200 unless a
        ``live_checks`` entry says the process cannot recover, e.g. a dead vLLM engine core,
        then 503 naming it, so Kubernetes restarts the pod) and ``/readyz`` (200 once every
        registered readiness check passes, else 503)."""

        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                line = await asyncio.wait_for(reader.readline(), 5)
                while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                    pass
                path = line.split()[1].decode() if len(line.split()) > 1 else "/"
                if path.startswith("/metrics"):
                    status, ctype, body = 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
                elif path.startswith("/healthz"):
                    dead = [n for n, check in self.live_checks.items() if not check()]
                    status, ctype = (503 if dead else 200), "text/plain"
                    body = f"not live: {', '.join(dead)}\n".encode() if dead else b"ok\n"
                elif path.startswith("/readyz"):
                    ok = all(check() for check in self.ready_checks)
                    down = ", ".join(self.not_ready())
                    status, ctype = (200 if ok else 503), "text/plain"
                    body = b"ready\n" if ok else f"not ready{': ' + down if down else ''}\n".encode()
                else:
                    status, ctype, body = 404, "text/plain", b"not found\n"
                reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
                writer.write(
                    f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    f"Connection: close\r\n\r\n".encode() + body
                )
                await writer.drain()
            except Exception:  # a broken probe connection is not our problem
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(on_conn, host, port)
        log.info("%s: /metrics /healthz /readyz on port %d", self.service, port)
        return server


_GLOBAL_SET = False


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans as JSON lines to one file, shared by several processes.

    Each export is one ``write`` on an ``O_APPEND`` descriptor, so lines of concurrent
    processes do not interleave. Fields: name, trace_id, span_id, parent_span_id, service,
    kind, start_ns, end_ns, status, attributes, links (trace_id/span_id), pid.
    """

    def __init__(self, path: str):
        self.path = path

    @staticmethod
    def to_dict(sp: ReadableSpan) -> dict:
        ctx = sp.get_span_context()
        return {
            "name": sp.name,
            "trace_id": format(ctx.trace_id, "032x"),
            "span_id": format(ctx.span_id, "016x"),
            "parent_span_id": format(sp.parent.span_id, "016x") if sp.parent else None,
            "service": sp.resource.attributes.get("service.name"),
            "kind": sp.kind.name,
            "start_ns": sp.start_time,
            "end_ns": sp.end_time,
            "status": sp.status.status_code.name,
            "attributes": dict(sp.attributes or {}),
            "links": [{"trace_id": format(lk.context.trace_id, "032x"), "span_id": format(lk.context.span_id, "016x")}
                      for lk in sp.links],
            "pid": os.getpid(),
        }

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = b"".join(orjson.dumps(self.to_dict(sp), default=str) + b"\n" for sp in spans)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("span export to %s failed: %r", self.path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def traced(name: str):
    """Decorator: run a (sync) function in a child span ``name`` of the current span, if any.

    Uses the process's tracer provider (set by :class:`Telemetry`); outside a trace it only
    calls the function.
    """
    tracer = trace.get_tracer("ocrstream")

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kw):
            if not trace.get_current_span().get_span_context().is_valid:
                return fn(*args, **kw)
            with tracer.start_as_current_span(name):
                return fn(*args, **kw)

        return wrapper

    return deco


class TraceIdLogFilter(logging.Filter):
    """Adds ``trace`` to log records: `` trace_id=<32 hex>`` inside a trace, else empty."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        record.trace = f" trace_id={ctx.trace_id:032x}" if ctx.is_valid else ""
        return True


def record_attrs(record) -> dict:
    """Span attributes naming a consumed record (anything with ``topic``, ``partition`` and
    ``offset``: a :class:`~services.common.records.Record`, an aiokafka ``ConsumerRecord``):
    ``topic[partition]@offset``."""
    return {"messaging.system": "kafka", "messaging.source.name": record.topic,
            "messaging.kafka.partition": record.partition, "messaging.kafka.offset": record.offset}
