"""Metrics (prometheus-client), tracing (OpenTelemetry) and the health/metrics HTTP endpoint.

The runner and the clients report here; handlers stay free of metric calls except for
domain events (cache hits, engine images) through the same object.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka import ConsumerRecord
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from services.common.settings import TelemetrySettings

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


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
        r = self.registry
        self.messages_in = Counter("ocrstream_messages_in", "Records consumed", ["stage", "topic"], registry=r)
        self.messages_out = Counter("ocrstream_messages_out", "Records produced and acknowledged", ["stage", "topic"], registry=r)
        self.requests_done = Counter("ocrstream_requests", "Requests finished by status/error code", ["stage", "status", "code"], registry=r)
        self.poisoned = Counter("ocrstream_poison_messages", "Records sent to the DLQ", ["stage"], registry=r)
        self.dep_retries = Counter("ocrstream_dependency_retries", "Retries while a dependency was down", ["stage", "error"], registry=r)
        self.commits = Counter("ocrstream_commits", "Offset commits", ["stage"], registry=r)
        self.cache = Counter("ocrstream_cache", "Cache lookups by outcome (hit, miss, joined, promoted, error)", ["stage", "outcome", "tier"], registry=r)
        self.batch_size = Histogram("ocrstream_batch_size", "Records per batch", ["stage"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.batch_seconds = Histogram("ocrstream_batch_seconds", "Batch wall time", ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.engine_images = Counter("ocrstream_engine_images", "Images run through the OCR engine", ["engine"], registry=r)
        self.store_seconds = Histogram("ocrstream_store_call_seconds", "S3/Redis/MySQL call latency", ["store", "op"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ready_checks: list[Callable[[], bool]] = []
        self.tracer = self._setup_tracing()

    # -- tracing ------------------------------------------------------------------------
    def _setup_tracing(self) -> trace.Tracer:
        provider = TracerProvider(resource=Resource.create({"service.name": f"ocrstream-{self.service}"}))
        if self.cfg.traces_exporter == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif self.cfg.traces_exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # optional extra

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.cfg.otlp_endpoint)))
        self.provider = provider
        return provider.get_tracer("ocrstream")

    @staticmethod
    def extract(headers: list[tuple[str, bytes]] | None):
        """OpenTelemetry context from Kafka headers (W3C ``traceparent``)."""
        carrier = {k: v.decode("latin-1") for k, v in (headers or []) if k in ("traceparent", "tracestate")}
        return propagate.extract(carrier)

    @staticmethod
    def inject(headers: list[tuple[str, bytes]] | None = None) -> list[tuple[str, bytes]]:
        """Kafka headers carrying the current span's context (``traceparent``)."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        out = [h for h in (headers or []) if h[0] not in carrier]
        out.extend((k, v.encode("latin-1")) for k, v in carrier.items())
        return out

    # -- runner hooks -------------------------------------------------------------------
    def batch_in(self, stage: str, records: list[ConsumerRecord]) -> None:
        """A batch of records was consumed."""
        for rec in records:
            self.messages_in.labels(stage, rec.topic).inc()
        self.batch_size.labels(stage).observe(len(records))

    def batch_done(self, stage: str, n: int, seconds: float) -> None:
        """A batch was handled, produced and committed in ``seconds``."""
        self.batch_seconds.labels(stage).observe(seconds)

    def message_out(self, stage: str, topic: str) -> None:
        """One produced record was acknowledged."""
        self.messages_out.labels(stage, topic).inc()

    def poison(self, stage: str) -> None:
        """A record was given up on and sent to the DLQ."""
        self.poisoned.labels(stage).inc()

    def dependency_retry(self, stage: str, error: str) -> None:
        """A dependency was down; the stage backs off and retries."""
        self.dep_retries.labels(stage, error).inc()

    def commit(self, stage: str) -> None:
        """Offsets were committed."""
        self.commits.labels(stage).inc()

    # -- HTTP: /metrics /healthz /readyz --------------------------------------------------
    async def serve(self, port: int, host: str = "0.0.0.0") -> asyncio.AbstractServer:
        """Serve ``/metrics`` (Prometheus text), ``/healthz`` (liveness) and ``/readyz``
        (200 once every registered readiness check passes, else 503)."""

        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                line = await asyncio.wait_for(reader.readline(), 5)
                while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                    pass
                path = line.split()[1].decode() if len(line.split()) > 1 else "/"
                if path.startswith("/metrics"):
                    status, ctype, body = 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
                elif path.startswith("/healthz"):
                    status, ctype, body = 200, "text/plain", b"ok\n"
                elif path.startswith("/readyz"):
                    ok = all(check() for check in self.ready_checks)
                    status, ctype, body = (200 if ok else 503), "text/plain", (b"ready\n" if ok else b"not ready\n")
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
