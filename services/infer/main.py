"""Wires the infer stage: settings, S3, the engine (loaded once, warmed up), handler and runner."""

from __future__ import annotations

import logging

from services.common.app import StageContext, run_stage
from services.common.images.decoding import DecoderPool
from services.common.s3 import ObjectStore
from services.common.settings import load_settings
from services.infer import gpu_metrics
from services.infer.engines import registry
from services.infer.engines.base import OcrEngine
from services.infer.handler import InferHandler
from services.infer.settings import InferSettings
from services.infer.window import WindowRunner

log = logging.getLogger(__name__)


def build_engine(s: InferSettings) -> OcrEngine:
    """The engine named by ``engine_kind`` (default ``engine.engine``), from the registry
    (:data:`services.infer.engines.registry.ENGINES`).

    Raises:
        ValueError: for an engine this build does not have.
    """
    return registry.build(s.engine_kind or s.engine.engine, s)


async def main(settings: InferSettings | None = None) -> None:
    """Run infer until SIGTERM: consume ``ocr.infer-interactive`` and ``ocr.infer`` in a window of
    records in flight (:class:`~services.infer.window.WindowRunner`, sized from the engine's
    slots: :meth:`InferSettings.window`), produce ``ocr.results``.

    ``/readyz`` answers 200 while the engine is ready: its ``health()`` is polled every
    ``telemetry.probe_interval_s`` (``engine`` in the not-ready list), and ``engine.ready``
    turns False as soon as a page finds the engine unavailable (then the runner reads that
    record again with backoff and commits nothing past it until it goes through). ``/metrics`` also carries
    GPU memory and utilisation per device when NVML sees a GPU (:mod:`services.infer.gpu_metrics`).
    """
    s = settings or load_settings(InferSettings)

    async def build(ctx: StageContext) -> InferHandler:
        engine = build_engine(s)
        log.info("infer: loading engine %s (%s @ %s)", engine.name, s.engine.model, s.engine.model_revision)
        await engine.start()
        # ready flips at once when a call finds the engine gone (EngineUnavailable); the probe
        # also notices it between batches and notices its return (engine.health sets ready)
        ctx.telemetry.ready_checks.append(lambda: engine.ready)
        ctx.telemetry.add_probe("engine", engine.health)
        if callable(getattr(engine, "dead", None)):  # vLLM: a dead engine core never comes back in-process
            ctx.telemetry.live_checks["engine"] = lambda: not engine.dead()
        ctx.telemetry.watch_engine(engine)  # ocrstream_engine_slots{,_busy}: is the engine kept full?
        gpu_metrics.watch(ctx.telemetry.registry)  # ocrstream_gpu_* when NVML sees a GPU; else nothing
        store = ObjectStore(s.s3, ctx.telemetry)
        ctx.telemetry.add_probe("s3", store.ping)
        decoder = DecoderPool(s.decode, s.limits)
        await decoder.start()
        return InferHandler(s, store, engine, ctx.telemetry, decoder)

    await run_stage(
        stage="infer", settings=s, topic=[s.topics.infer_interactive, s.topics.infer], group_id=s.infer_group_id,
        build_handler=build, max_poll_interval_ms=s.infer_max_poll_interval_ms,
        make_runner=lambda handler, **common: _window_runner(s, handler, **common),
    )


def _window_runner(s: InferSettings, handler: InferHandler, **common) -> WindowRunner:
    """The window runner sized from the engine's slots (:meth:`InferSettings.window`)."""
    max_in_flight, reserve = s.window(handler.engine.slots)
    log.info("infer: a window of %d records in flight, %d reserved for the interactive lane", max_in_flight, reserve)
    return WindowRunner(handler=handler, max_in_flight=max_in_flight, interactive_reserve=reserve, **common)
