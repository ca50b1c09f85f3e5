"""The engine registry: engine name -> the class that implements it.

Adding an engine is one module (a subclass of :class:`~services.infer.engines.base.OcrEngine`
with ``name``, ``tasks`` and a ``from_settings(settings)`` classmethod) plus one line in
:data:`ENGINES` and its row of tasks in :data:`schemas.tasks.ENGINE_TASKS`
(``docs/contributing.md``, "Adding an engine"). Classes are imported when first
asked for, so the registry imports nothing heavy: each engine imports its runtime (RapidOCR,
vLLM) in ``start()``.
"""

from __future__ import annotations

import importlib

from schemas.tasks import engines_for as _engines_for
from services.infer.engines.base import OcrEngine

ENGINES: dict[str, str] = {
    "rapidocr": "services.infer.engines.rapid:RapidOcrEngine",
    "vllm": "services.infer.engines.vllm_engine:VllmEngine",
    "openai": "services.infer.engines.openai_engine:OpenAiEngine",
}
"""Engine name (``engine.engine`` / ``OCRSTREAM_ENGINE_KIND``) -> ``module:Class``."""


def engine_class(name: str) -> type[OcrEngine]:
    """The class registered as ``name``.

    Raises:
        ValueError: no engine of that name is registered.
    """
    target = ENGINES.get(name)
    if target is None:
        raise ValueError(f"unknown engine {name!r}: use {', '.join(ENGINES)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def build(name: str, settings) -> OcrEngine:
    """A new (not started) engine ``name`` built from :class:`~services.infer.settings.InferSettings`.

    Raises:
        ValueError: no engine of that name is registered.
    """
    return engine_class(name).from_settings(settings)


def engines_for(task: str) -> tuple[str, ...]:
    """The registered engines that can do ``task`` (in registry order), from the one table
    :data:`schemas.tasks.ENGINE_TASKS` (each engine class's ``tasks`` is its row); imports no engine."""
    able = _engines_for(task)
    return tuple(n for n in ENGINES if n in able)
