"""The HTTP door's clients and counters, made once per process and injected into the serving modules.

:class:`Clients` holds Kafka producers, S3, Redis, MariaDB, the completion hub, the guard (keys
and limits), the upload gate and the decoder pool, with their lifecycle
(:meth:`Clients.start`, :meth:`Clients.stop`, :meth:`Clients.begin_close`) and the door's
Prometheus metrics. Kafka clients need the running loop: they are made in :meth:`Clients.start`.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlencode

from prometheus_client import Counter, Gauge, Histogram

from services.api.hub import CompletionHub
from services.api.protocol import Links
from services.api.serving_keys import Guard
from services.api.settings import ApiSettings
from services.api.uploads import UploadGate
from services.common.app import kafka_reachable
from services.common.cache.entries import ResultCache
from services.common.db import Database
from services.common.results.rows import ResultRows
from services.common.images.decoding import DecoderPool
from services.common.kafka import RenewingProducer, make_producer
from services.common.cache.outputs import OutputLru
from services.common.s3 import ObjectStore
from services.common.telemetry import Telemetry

log = logging.getLogger(__name__)


class CacheHits:
    """Cache hits published on ``ocr.results`` for the sink, fire-and-forget on their own producer
    (with a longer linger: batching them costs the caller nothing and saves a produce request per
    hit, bench/http_bench.py); a hit with a callback is awaited (:meth:`published`).

    Args:
        producer: The hit producer (started).
        topic: ``ocr.results``.
        failed: Counts a publish that failed.
    """

    def __init__(self, producer: RenewingProducer, topic: str, failed: Counter):
        self.producer = producer
        self.topic = topic
        self._failed = failed
        self._sends: set[asyncio.Future] = set()

    def send(self, request_id: str, value: bytes, key: bytes, headers: list) -> None:
        """Queue one cache hit's result event (the send is referenced until done)."""
        fut = asyncio.ensure_future(self.producer.send(self.topic, value, key=key, headers=headers))
        fut._ocr_request_id = request_id  # found again by published() when there is a callback
        self._sends.add(fut)  # referenced until done (the loop keeps only weak references to tasks)
        fut.add_done_callback(self._sends.discard)
        fut.add_done_callback(self._count)

    async def published(self, request_id: str) -> None:
        """Wait until the cache hit of ``request_id`` just sent is acknowledged by Kafka.

        Raises:
            Exception: whatever the publish failed with (the caller answers 503 ``unavailable``).
        """
        fut = next((f for f in self._sends if getattr(f, "_ocr_request_id", None) == request_id), None)
        if fut is not None:
            await (await fut)

    async def drain(self) -> None:
        """Wait for every send still waiting for room in the producer's buffer (at stop: aiokafka
        refuses messages once ``stop()`` has begun, and each such hit would lose its row)."""
        if self._sends:
            await asyncio.wait(set(self._sends))

    def _count(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception():
            self._failed.inc()
            log.warning("api: publishing a cache hit failed: %r", None if fut.cancelled() else fut.exception())
            return
        inner = fut.result()  # the broker's acknowledgement, awaited in the background
        inner.add_done_callback(lambda f: f.cancelled() or f.exception() is None or self._failed.inc())


class Clients:
    """Clients and counters behind the routes (one per process).

    Args:
        settings: The door's settings.
    """

    def __init__(self, settings: ApiSettings):
        s = self.s = settings
        self.telemetry = Telemetry("api", s.telemetry)
        self.producer: RenewingProducer | None = None  # made in start()
        self.hits: CacheHits | None = None
        self.store = ObjectStore(s.s3, self.telemetry)
        self.cache = ResultCache(s.redis, self.telemetry, stage="api")
        self.db = Database(s.mysql, pool_size=8, telemetry=self.telemetry)
        self.rows = ResultRows(self.db)
        self.hub: CompletionHub | None = None
        self.guard = Guard(s, self.cache, self.db, self.telemetry)
        self.outputs = OutputLru(self.store, s.http_result_lru_entries, s.http_result_lru_bytes)
        self.uploads = UploadGate(s.http_upload_budget_bytes, s.http_small_upload_budget_bytes, s.http_small_body_bytes,
                                  s.http_uploads_per_client, s.http_uploads_per_key)
        self.pace = s.body_pace()
        self.decoder = DecoderPool(s.decode, s.limits)  # format checks in killable processes
        self.started = asyncio.Event()
        self.closing = asyncio.Event()  # set at SIGTERM (serve): event streams end at once
        self._loop: asyncio.AbstractEventLoop | None = None
        self._metrics()
        self.telemetry.ready_checks.append(self.started.is_set)

    def _metrics(self) -> None:
        r = self.telemetry.registry
        self.http_requests = Counter("ocrstream_http_requests", "HTTP submissions and reads by outcome",
                                     ["route", "outcome"], registry=r)
        self.http_staged = Counter("ocrstream_http_staged_uploads", "Uploads (raw bodies, file parts) streamed to S3 by how "
                                   "their multipart upload ended: completed, aborted, abort_failed",
                                   ["outcome"], registry=r)
        self.http_seconds = Histogram("ocrstream_http_seconds", "Time to answer, by route and outcome",
                                      ["route", "outcome"], registry=r,
                                      buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30, 60))
        Gauge("ocrstream_http_waiters", "Completion waiters held: one per long-poll, one per request an event "
              "stream watches", registry=r).set_function(lambda: self.hub.waiting if self.hub else 0)
        self.http_streams = Gauge("ocrstream_http_event_streams", "GET /v1/events streams open", registry=r)
        held = Gauge("ocrstream_http_upload_held_bytes", "Bytes of request bodies held in memory now, by budget: "
                     "uploads (OCRSTREAM_HTTP_UPLOAD_BUDGET_BYTES), small (OCRSTREAM_HTTP_SMALL_UPLOAD_BUDGET_BYTES)",
                     ["budget"], registry=r)
        held.labels("uploads").set_function(lambda: self.uploads.budget.used)
        held.labels("small").set_function(lambda: self.uploads.small.used if self.uploads.small is not None else 0)
        Gauge("ocrstream_http_uploads_open", "Uploads (POST /v1/ocr and /v1/ocr/batch bodies) admitted and not yet "
              "ended", registry=r).set_function(lambda: self.uploads.open_uploads)

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect Kafka (producers and completion reader), start probes.

        Raises:
            aiokafka.errors.KafkaError: Kafka unreachable (the process exits; k8s restarts it).
        """
        self._loop = asyncio.get_running_loop()
        self.producer = make_producer(self.s.kafka, client_id="ocrstream-api")
        self.telemetry.watch_producer(self.producer)
        await self.producer.start()
        hit_producer = make_producer(self.s.kafka, client_id="ocrstream-api-hits", linger_ms=self.s.http_hit_linger_ms)
        self.telemetry.watch_producer(hit_producer)
        await hit_producer.start()
        self.hits = CacheHits(hit_producer, self.s.topics.results,
                              self.http_requests.labels("submit", "cache_hit_publish_failed"))
        self.hub = CompletionHub(self.s, self.s.http_max_waiters)
        await self.hub.start()
        await self.decoder.start()
        self.telemetry.add_probe("kafka", lambda: kafka_reachable(self.s.kafka.bootstrap_servers))
        self.telemetry.add_probe("s3", self.store.ping)
        self.started.set()
        log.info("api: listening on http://%s:%d", self.s.http_host, self.s.http_port)

    def begin_close(self) -> None:
        """The process was told to stop (SIGTERM): end every event stream now, without its ``end``
        event, so an ``EventSource`` reconnects to another replica, and answer every long-poll
        ``pending`` now (the client asks again, elsewhere), instead of holding uvicorn's graceful
        shutdown for ``shutdown_timeout_s`` and then cutting them off. Safe to call
        from a signal handler (it only schedules the work on the door's loop); idempotent."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.closing.set)

    async def stop(self) -> None:
        """Stop the reader, flush the producers, close the pools.

        Cache hits already answered but not yet in the hit producer's buffer are awaited first
        (:meth:`CacheHits.drain`); each send ends within the producer's ``request_timeout_ms``.
        """
        self.started.clear()
        await self.hub.stop()
        await self.hits.drain()
        await self.hits.producer.stop()  # flushes the cache hits still lingering
        await self.producer.stop()
        await self.decoder.close()
        await self.cache.close()
        self.telemetry.close()

    # -- helpers ------------------------------------------------------------------------------
    def count_staged(self, outcome: str) -> None:
        """Count how a streamed upload's multipart upload ended (``completed``, ``aborted``, ``abort_failed``)."""
        self.http_staged.labels(outcome).inc()

    def links(self, rid: str) -> Links:
        """Where to read request ``rid``: now, and by the longest long-poll."""
        return Links(self=f"/v1/ocr/{rid}", wait=f"/v1/ocr/{rid}?wait={int(self.s.http_wait_max_s)}")

    @staticmethod
    def events_link(rids: list[str]) -> str:
        """``GET /v1/events`` for these ids (the server's longest timeout: its default)."""
        return "/v1/events?" + urlencode([("id", rid) for rid in rids])
