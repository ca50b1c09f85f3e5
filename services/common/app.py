"""Stage lifecycle, read top to bottom: settings -> clients -> signal handlers -> run -> drain -> close."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from tenacity import AsyncRetrying, stop_after_attempt, wait_exponential

from services.common.deaths import admin_reader
from services.common.kafka import (
    BROKER_DEFAULT_MESSAGE_BYTES,
    RenewingProducer,
    make_admin,
    make_consumer,
    make_producer,
    topic_message_limits,
)
from services.common.retry import capped_backoff_s, retry_outages
from services.common.runner import Handler, StageRunner
from services.common.settings import CommonSettings
from services.common.telemetry import Telemetry, TraceIdLogFilter

log = logging.getLogger("ocrstream")


def setup_logging(stage: str, level: str) -> None:
    """Log lines as ``time level stage message [trace_id=...]`` to stderr."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {stage} %(name)s: %(message)s%(trace)s",
        stream=sys.stderr,
        force=True,
    )
    for h in logging.getLogger().handlers:  # `` trace_id=<hex>`` on lines logged inside a request's trace
        h.addFilter(TraceIdLogFilter())
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # its INFO lines carry full URLs (webhook tokens)


@dataclass
class StageContext:
    """What a stage's handler factory receives: settings, telemetry and the Kafka producer."""

    settings: CommonSettings
    telemetry: Telemetry
    producer: RenewingProducer


async def _start_with_retry(name: str, start: Callable[[], Awaitable[None]], stop: asyncio.Event, cap_s: float) -> None:
    """``start()`` (a Kafka client's), retried while Kafka is not reachable (1 s doubling, at most
    ``cap_s``) until ``stop`` is set."""

    def on_retry(attempt: int, exc: BaseException, delay: float) -> None:
        log.warning("%s: Kafka not reachable (%r); retry %d in %.1fs", name, exc, attempt, delay)

    await retry_outages(start, outage=lambda exc: isinstance(exc, (KafkaError, OSError)), stop=stop,
                        delay=lambda n: capped_backoff_s(n, cap_s, first_s=1.0), on_retry=on_retry)


async def kafka_reachable(bootstrap_servers: str, timeout_s: float = 2.0) -> bool:
    """True if a TCP connection to one of the bootstrap servers opens (a cheap readiness check)."""
    for hostport in bootstrap_servers.split(","):
        host, _, port = hostport.strip().rpartition(":")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host or "127.0.0.1", int(port or 9092)), timeout_s)
        except (OSError, ValueError, asyncio.TimeoutError):
            continue
        writer.close()
        return True
    return False


async def _message_limits(stage: str, settings: CommonSettings) -> dict[str, int]:
    """Each topic's ``max.message.bytes`` (5 tries), else Kafka's default for every topic."""
    try:
        async for attempt in AsyncRetrying(stop=stop_after_attempt(5), wait=wait_exponential(0.5, max=5), reraise=True):
            with attempt:
                return await topic_message_limits(settings.kafka, settings.topics.all())
    except Exception as exc:  # noqa: BLE001 - the broker default is the safe guess
        log.warning("%s: cannot read the topics' max.message.bytes (%r); assuming Kafka's default %d",
                    stage, exc, BROKER_DEFAULT_MESSAGE_BYTES)
    return dict.fromkeys(settings.topics.all(), BROKER_DEFAULT_MESSAGE_BYTES)


async def close_in_turn(stage: str, closes: list[tuple[str, Callable[[], Awaitable[object]]]]) -> None:
    """Await each ``(what, close)`` of ``closes`` in order. One that raises (a timeout included) is
    logged as ``closing the <what> failed`` and the next still runs, so a client that hangs at
    shutdown never leaves the others open."""
    for what, close in closes:
        try:
            await close()
        except Exception as exc:  # noqa: BLE001 - logged; the next client still closes
            log.warning("%s: closing the %s failed: %r", stage, what, exc)


async def _run_until_stopped(stage: str, runner: StageRunner, stop: asyncio.Event,
                             shutdown_timeout_s: float) -> asyncio.Task:
    """Run ``runner`` until it fails or ``stop`` is set, then give the batch in flight up to
    ``shutdown_timeout_s`` seconds to finish. Returns the runner's task (done, unless it ran past
    the bound: its batch is then redelivered)."""
    task = asyncio.create_task(runner.run(stop))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if task.done() and task.exception():
        log.error("%s: runner failed: %r", stage, task.exception())
    else:
        log.info("%s: stopping: finishing the batch in flight (up to %.0fs)", stage, shutdown_timeout_s)
        try:
            await asyncio.wait_for(task, shutdown_timeout_s)
        except asyncio.TimeoutError:
            log.warning("%s: batch did not finish in time; it will be redelivered", stage)
    stopped.cancel()
    return task


async def run_stage(
    *,
    stage: str,
    settings: CommonSettings,
    topic: str | list[str],
    group_id: str,
    build_handler: Callable[[StageContext], Awaitable[Handler]],
    max_batch: int = 64,
    max_wait_ms: int = 0,
    max_poll_interval_ms: int | None = None,
    drain_on_revoke: bool = False,
    make_runner: Callable[..., StageRunner] | None = None,
) -> None:
    """Run one stage until SIGTERM/SIGINT, then finish the batch in flight, commit and exit.

    Args:
        stage: Stage name.
        settings: The stage's settings.
        topic: Input topic, or topics (read in one consumer group).
        group_id: Consumer group (each stage has its own).
        build_handler: Opens the stage's clients and returns its handler (after any warm-up).
        max_batch: Most records per batch (the batch runner).
        max_wait_ms: Longest wait for a batch to fill (the batch runner).
        max_poll_interval_ms: Override of the consumer's ``max.poll.interval.ms``.
        drain_on_revoke: See :class:`~services.common.runner.StageRunner`.
        make_runner: Builds the stage's runner instead of the batch runner: called with the
            handler and the runner's keyword arguments (``stage``, ``consumer``, ``producer``,
            ``handler``, ...: :class:`~services.common.runner.StageRunner`'s but the batch ones);
            infer's window runner (:class:`services.infer.window.WindowRunner`) is built so. It
            may keep its progress in the commit metadata, so it is always given the committed
            offsets reader (``read_committed``).
    """
    topics = [topic] if isinstance(topic, str) else list(topic)
    setup_logging(stage, settings.telemetry.log_level)
    telemetry = Telemetry(stage, settings.telemetry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    started = asyncio.Event()  # readiness: Kafka connected, clients open, engine warmed up
    telemetry.ready_checks.append(lambda: started.is_set() and not stop.is_set())
    telemetry.add_probe("kafka", lambda: kafka_reachable(settings.kafka.bootstrap_servers))
    server = None
    if settings.telemetry.metrics_port:
        server = await telemetry.serve(settings.telemetry.metrics_port)

    producer = make_producer(settings.kafka, client_id=f"ocrstream-{stage}")
    telemetry.watch_producer(producer)
    await _start_with_retry(stage, producer.start, stop, settings.retry_max_backoff_s)
    size_limits = await _message_limits(stage, settings)
    admin = None
    if settings.poison_after_deaths or make_runner is not None:  # reads the deaths (or a runner's progress) in the commit metadata
        admin = make_admin(settings.kafka, f"ocrstream-{stage}-offsets")
        await _start_with_retry(stage, admin.start, stop, settings.retry_max_backoff_s)
    ctx = StageContext(settings=settings, telemetry=telemetry, producer=producer)
    handler = await build_handler(ctx)
    consumer: AIOKafkaConsumer = make_consumer(
        settings.kafka, [], group_id, client_id=f"ocrstream-{stage}", max_poll_interval_ms=max_poll_interval_ms,
    )
    common = dict(stage=stage, consumer=consumer, producer=producer, telemetry=telemetry,
                  max_attempts=settings.max_attempts, max_backoff_s=settings.retry_max_backoff_s,
                  dlq_topic=settings.topics.dlq, size_limits=size_limits, poison_after_deaths=settings.poison_after_deaths,
                  read_committed=admin_reader(admin, group_id) if admin is not None else None)
    if make_runner is not None:
        runner: StageRunner = make_runner(handler=handler, **common)
    else:
        runner = StageRunner(handler=handler, max_batch=max_batch, max_wait_ms=max_wait_ms,
                             drain_on_revoke=drain_on_revoke, **common)
    consumer.subscribe(topics, listener=runner.listener)  # before start: the first join already has it
    await _start_with_retry(stage, consumer.start, stop, settings.retry_max_backoff_s)
    started.set()
    log.info("%s: consuming %s as group %s", stage, ", ".join(topics), group_id)
    task = await _run_until_stopped(stage, runner, stop, settings.shutdown_timeout_s)
    # each client is closed on its own: one that hangs or fails (a broker gone mid-shutdown) must
    # not leave the others open (the handler's pools, decoder processes, engine)
    closes = [("consumer", lambda: asyncio.wait_for(consumer.stop(), 10)),
              ("producer", lambda: asyncio.wait_for(producer.stop(), 10))]
    if admin is not None:
        closes.append(("admin client", lambda: asyncio.wait_for(admin.close(), 10)))
    closes.append(("handler", handler.close))
    try:
        await close_in_turn(stage, closes)
    finally:
        if server:
            server.close()
        telemetry.close()
    log.info("%s: stopped", stage)
    if task.done() and not task.cancelled() and task.exception():
        raise SystemExit(1)
