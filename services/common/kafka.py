"""aiokafka producer/consumer factories and the outgoing-message record."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import ProducerClosed, TopicAlreadyExistsError, UnknownTopicOrPartitionError

from services.common.errors import PRODUCER_STATE_ERRORS
from services.common.settings import KafkaSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outgoing:
    """One message a handler wants produced.

    Attributes:
        topic: Destination topic.
        key: Partitioning key (content SHA-256, or request id on ``ocr.completed``).
        value: Serialized event (orjson bytes).
        headers: Kafka headers, e.g. ``traceparent``.
    """

    topic: str
    key: str | None
    value: bytes
    headers: list[tuple[str, bytes]] = field(default_factory=list)


def _security_kwargs(cfg: KafkaSettings) -> dict:
    kw: dict = {"security_protocol": cfg.security_protocol}
    if cfg.security_protocol in ("SSL", "SASL_SSL"):
        ctx = ssl.create_default_context(cafile=cfg.ssl_cafile)
        if cfg.ssl_certfile:
            ctx.load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
        kw["ssl_context"] = ctx
    if cfg.sasl_mechanism:
        kw["sasl_mechanism"] = cfg.sasl_mechanism
        kw["sasl_plain_username"] = cfg.sasl_username
        kw["sasl_plain_password"] = cfg.sasl_password.get_secret_value() if cfg.sasl_password else None
    return kw


def make_producer(cfg: KafkaSettings, client_id: str, linger_ms: int | None = None) -> RenewingProducer:
    """An idempotent producer (``acks=all`` by default) that renews its producer id when the broker
    loses its state (:class:`RenewingProducer`); call ``await start()`` before use.

    Args:
        cfg: Broker, acks and batching settings.
        client_id: Kafka ``client.id`` (shows in broker logs and quotas).
        linger_ms: Batching delay in ms instead of ``cfg.linger_ms`` (for fire-and-forget sends
            whose latency nobody waits on).
    """
    return RenewingProducer(lambda: AIOKafkaProducer(
        bootstrap_servers=cfg.bootstrap_servers,
        client_id=client_id,
        acks="all" if cfg.acks == "all" else int(cfg.acks),
        enable_idempotence=cfg.enable_idempotence and cfg.acks == "all",
        linger_ms=cfg.linger_ms if linger_ms is None else linger_ms,
        max_request_size=cfg.max_request_size,
        request_timeout_ms=cfg.request_timeout_ms,
        **_security_kwargs(cfg),
    ), client_id, start_timeout_s=max(cfg.request_timeout_ms / 1000, 1.0))


class RenewingProducer:
    """An ``AIOKafkaProducer`` that is replaced by a fresh one (a new producer id, sequence numbers
    from 0) when a send fails with one of :data:`~services.common.errors.PRODUCER_STATE_ERRORS`.

    An idempotent producer numbers the batches of each partition. When the broker loses that
    numbering (a restart that drops the producer's state, aio-libs/aiokafka#1017) or a refused
    batch leaves a gap in it, the broker answers every later batch of that partition with
    ``OUT_OF_ORDER_SEQUENCE_NUMBER`` and aiokafka never recovers. The Java client resets its
    producer id in that case for a producer without a transactional id (KIP-360); this does the
    same with the public API: the failed send's future still raises (the runner sends it again,
    :func:`~services.common.errors.is_transient`), every send made after the failure waits for the
    fresh producer, and the old one is stopped in the background (its pending batches settle,
    failed or acknowledged). A renewal that cannot start in ``start_timeout_s`` leaves the old
    producer in place; its next such error tries again.

    Ordering: a message sent again after a renewal may land after one sent later to the same
    partition, as after a stage restart (delivery is at least once, docs/delivery.md).

    Args:
        factory: Makes an unstarted ``AIOKafkaProducer`` (called once per renewal).
        name: For logs and the ``producer`` label of ``ocrstream_producer_renewals_total`` (the client id).
        start_timeout_s: Bound on a renewal's ``start()`` (metadata and a producer id), s.
    """

    def __init__(self, factory: Callable[[], AIOKafkaProducer], name: str, start_timeout_s: float = 30.0):
        self._factory = factory
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.current = factory()
        self.renewals = 0
        self._renewal: asyncio.Task | None = None
        self._retired: set[asyncio.Task] = set()
        self._closing = False

    async def start(self) -> None:
        """Connect (``AIOKafkaProducer.start``: fetches metadata and, idempotent, a producer id)."""
        await self.current.start()

    async def stop(self) -> None:
        """Flush and close the current producer and every one a renewal retired; a renewal under
        way is cancelled, and none starts from here on."""
        self._closing = True
        if self._renewal is not None:
            self._renewal.cancel()
            await asyncio.wait({self._renewal})
        if self._retired:
            await asyncio.wait(set(self._retired))
        await self.current.stop()

    async def send(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                   partition: int | None = None, headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future:
        """``AIOKafkaProducer.send``: queue the message and return the future of its acknowledgement
        (raises as the producer does, e.g. ``MessageSizeTooLargeError``, ``KafkaTimeoutError``)."""
        while True:
            if self._renewal is not None:
                await asyncio.wait({self._renewal})  # its outcome is its own; a cancelled send leaves it be
            producer = self.current
            try:
                fut = await producer.send(topic, value, key=key, partition=partition, headers=headers)
            except ProducerClosed:
                if producer is not self.current and not self._closing:
                    continue  # retired while this send waited in it (metadata, a full buffer)
                raise
            fut.add_done_callback(lambda f: self._settled(producer, f))
            return fut

    async def send_and_wait(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                            partition: int | None = None, headers: list[tuple[str, bytes]] | None = None):
        """:meth:`send` and wait for the acknowledgement (the ``RecordMetadata``)."""
        return await (await self.send(topic, value, key=key, partition=partition, headers=headers))

    def _settled(self, producer: AIOKafkaProducer, fut: asyncio.Future) -> None:
        if self._closing or fut.cancelled() or not isinstance(fut.exception(), PRODUCER_STATE_ERRORS):
            return
        if producer is self.current and self._renewal is None:
            self._renewal = asyncio.ensure_future(self._renew(producer, fut.exception()))

    async def _renew(self, old: AIOKafkaProducer, error: BaseException) -> None:
        log.warning("kafka: producer %s got %s; renewing it (a fresh producer id, sequence numbers from 0)",
                    self.name, type(error).__name__)
        fresh: AIOKafkaProducer | None = None
        try:
            fresh = self._factory()
            await asyncio.wait_for(fresh.start(), self.start_timeout_s)
        except BaseException as exc:
            if fresh is not None:
                self._retire(fresh)
            if not isinstance(exc, Exception):
                raise  # cancelled by stop()
            log.warning("kafka: producer %s could not be renewed now (%r); the next such error tries again",
                        self.name, exc)
            return
        finally:
            self._renewal = None
        if self._closing:
            await fresh.stop()
            return
        self.current = fresh
        self.renewals += 1
        self._retire(old)

    def _retire(self, producer: AIOKafkaProducer) -> None:
        """Stop ``producer`` in the background (:meth:`stop` waits for it); an error is logged."""
        task = asyncio.ensure_future(producer.stop())
        self._retired.add(task)

        def done(t: asyncio.Task) -> None:
            self._retired.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("kafka: a retired producer of %s failed to stop: %r", self.name, t.exception())
        task.add_done_callback(done)


def make_consumer(
    cfg: KafkaSettings,
    topics: list[str],
    group_id: str | None,
    client_id: str,
    max_poll_interval_ms: int | None = None,
    auto_offset_reset: str = "earliest",
) -> AIOKafkaConsumer:
    """A consumer with manual commits (``enable_auto_commit=False``); offsets are committed
    by the runner only after everything a batch caused is durable.

    Call ``subscribe`` (done here when ``topics`` is given) then ``await start()``.
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=cfg.bootstrap_servers,
        group_id=group_id,
        client_id=client_id,
        enable_auto_commit=False,
        auto_offset_reset=auto_offset_reset,
        session_timeout_ms=cfg.session_timeout_ms,
        heartbeat_interval_ms=cfg.heartbeat_interval_ms,
        max_poll_interval_ms=max_poll_interval_ms or cfg.max_poll_interval_ms,
        request_timeout_ms=max(cfg.request_timeout_ms, cfg.session_timeout_ms + 5_000),
        **_security_kwargs(cfg),
    )
    if topics:
        consumer.subscribe(topics)
    return consumer


def make_admin(cfg: KafkaSettings, client_id: str) -> AIOKafkaAdminClient:
    """An admin client (``await start()`` before use, ``await close()`` after)."""
    return AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers, client_id=client_id, **_security_kwargs(cfg))


BROKER_DEFAULT_MESSAGE_BYTES = 1_048_588
"""Kafka's default ``message.max.bytes`` (1 MiB + 12): assumed for a topic whose limit cannot be read."""


async def topic_message_limits(cfg: KafkaSettings, topics: list[str],
                               unknown_waits_s: tuple[float, ...] = (0.1, 0.2, 0.4, 0.8)) -> dict[str, int]:
    """Each topic's ``max.message.bytes`` (bytes), read with DescribeConfigs, so a producer can
    replace a message the broker would refuse before sending it (a refused batch leaves a gap in
    an idempotent producer's sequence numbers: every later send to that partition then fails).

    A topic the broker answers ``UNKNOWN_TOPIC_OR_PARTITION`` (error 3) for is asked again after
    each of ``unknown_waits_s`` (seconds): a topic created a moment ago reaches each broker's
    metadata a little after CreateTopics returns. A topic whose limit still cannot be read (missing,
    not authorised) gets :data:`BROKER_DEFAULT_MESSAGE_BYTES`, with a warning.

    Raises:
        Exception: the brokers cannot be asked (a ``KafkaError`` or a timeout, as the admin
            client raises them).
    """
    limits = dict.fromkeys(topics, BROKER_DEFAULT_MESSAGE_BYTES)
    admin = make_admin(cfg, "ocrstream-limits")
    failed: dict[str, int] = {}
    ask = list(topics)
    try:
        await admin.start()
        for wait_s in (*unknown_waits_s, None):
            responses = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, t, {"max.message.bytes": None}) for t in ask])
            for response in responses:
                for error_code, _, _, name, entries in response.resources:
                    if error_code != 0:
                        failed[name] = error_code
                        continue
                    failed.pop(name, None)
                    for entry in entries:
                        if entry[0] == "max.message.bytes" and name in limits:
                            limits[name] = int(entry[1])
            ask = [t for t in ask if failed.get(t) == UnknownTopicOrPartitionError.errno]
            if not ask or wait_s is None:
                break
            await asyncio.sleep(wait_s)
    finally:
        await admin.close()
    for name, error_code in failed.items():
        log.warning("kafka: cannot read max.message.bytes of topic %s (error %d); assuming Kafka's default %d",
                    name, error_code, BROKER_DEFAULT_MESSAGE_BYTES)
    return limits


async def create_topics(cfg: KafkaSettings, names: list[str], compacted: list[str] | None = None) -> list[str]:
    """Create the topics that do not exist yet, with ``cfg.partitions`` partitions each and
    ``max.message.bytes`` = ``cfg.max_request_size`` (brokers default to 1 MiB; a large result or
    completion must fit). Existing topics are left as they are: raise theirs with
    ``kafka-configs.sh --alter --entity-type topics --entity-name T --add-config max.message.bytes=N``
    (a message a topic refuses is replaced by a DLQ stub, :mod:`services.common.runner`).

    Args:
        cfg: Kafka settings (partitions, replication factor, message size).
        names: The topics.
        compacted: Those of ``names`` created with ``cleanup.policy=compact`` (state changelogs).

    Returns:
        The names that were created (empty when all existed).
    """
    admin = make_admin(cfg, "ocrstream-init")
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        missing = [n for n in names if n not in existing]
        if missing:
            try:
                await admin.create_topics(
                    [NewTopic(n, cfg.partitions, cfg.replication_factor,
                              topic_configs={"max.message.bytes": str(cfg.max_request_size),
                                             **({"cleanup.policy": "compact"} if n in (compacted or ()) else {})})
                     for n in missing]
                )
            except TopicAlreadyExistsError:
                pass
        return missing
    finally:
        await admin.close()


async def topic_partitions(cfg: KafkaSettings, topic: str, client_id: str) -> set[int]:
    """The partition numbers of ``topic`` as the brokers describe it now (empty: no such topic).

    Raises:
        Exception: the brokers cannot be asked (a ``KafkaError`` or a timeout, as the admin
            client raises them).
    """
    admin = make_admin(cfg, client_id)
    try:
        await admin.start()
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return {p["partition"] for d in described if d.get("topic") == topic for p in d.get("partitions") or []}


async def check_copartitioned(cfg: KafkaSettings, names: list[str], timeout_s: float = 30.0) -> None:
    """Refuse to run when co-partitioned topics (``ocr.requests`` and dedup's changelog) differ in
    partition count or are missing: a partition's keyed state would be restored from, and written
    to, the changelog partition of other keys.

    Raises:
        SystemExit: with a message naming each topic's count (fix: ``ocrstream init`` on an empty
            cluster, or add partitions so they match).
    """
    admin = make_admin(cfg, "ocrstream-partition-check")
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            described = await admin.describe_topics(names)
    finally:
        await admin.close()
    counts = {d["topic"]: len(d.get("partitions") or []) for d in described}
    if any(counts.get(n, 0) == 0 for n in names) or len(set(counts.values())) != 1:
        raise SystemExit(f"topics {', '.join(f'{n} ({counts.get(n, 0)} partitions)' for n in names)} must exist "
                         "with the same partition count: run `ocrstream init`, or add partitions so they match")
