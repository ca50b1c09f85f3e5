"""Dialects: what a VLM engine (``vllm``, ``openai``) sends a given model for a task other
than ``ocr`` (the instruction, the sampling, ``max_tokens``) and how it reads the answer.

Task ``ocr`` (text spotting) does not go through a dialect: it keeps the engines' own prompt
(``OCRSTREAM_VLLM_PROMPT`` / ``OCRSTREAM_OPENAI_PROMPT``), sampling and parser
(:mod:`services.infer.engines.hunyuan`), exactly as before tasks existed.

Dialects (``OCRSTREAM_VLM_DIALECT``; ``auto``: ``hunyuan`` for a model named like HunyuanOCR,
else ``generic``):

* ``hunyuan`` (:mod:`.hunyuan`): HunyuanOCR's own task prompts and sampling, as
  Tencent-Hunyuan/HunyuanOCR publishes them;
* ``generic`` (:mod:`.generic`): plain English instructions for any OpenAI-compatible OCR VLM.

Adding a dialect: a :class:`Dialect` subclass in a module here and one line in :data:`DIALECTS`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from schemas.tasks import TASKS
from services.common.cache.prompts import is_hunyuan, resolve_dialect  # noqa: F401 - is_hunyuan re-exported
from services.infer.engines.base import EngineOutput, EngineTask, UnparsableOutput
from services.infer.engines.dialects import parsers


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """What is sent for one task: the instruction and the sampling.

    Attributes:
        prompt: The instruction text (after the image, in the user turn).
        max_tokens: Generation cap in tokens (the engine caps it at its own ``max_tokens``).
        temperature: 0.0 = greedy.
        top_p: Nucleus sampling (1.0 = off).
        top_k: vLLM's ``top_k`` extra (None: not sent, for servers that lack it; -1 = off).
        repetition_penalty: vLLM's extra (None: not sent; 1.0 = off).
    """

    prompt: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    repetition_penalty: float | None = None


class Dialect:
    """Prompts, sampling and parsers of one model family for the tasks other than ``ocr``.

    Subclasses set :attr:`name`, :attr:`source` (where the prompts come from) and implement
    :meth:`sampling`; :meth:`parse` reads answers with :mod:`.parsers` and may be overridden.
    """

    name = "dialect"
    source = ""
    tasks: frozenset[str] = frozenset(t for t in TASKS if t != "ocr")

    def sampling(self, task: EngineTask) -> Sampling:
        """The instruction and sampling for ``task`` (a task of :attr:`tasks`).

        Raises:
            KeyError: a task this dialect has no prompt for.
        """
        raise NotImplementedError

    def parse(self, task: EngineTask, text: str,
              warnings: tuple[str, ...] = ()) -> tuple[str | dict[str, str | None], tuple[str, ...]]:
        """The model's answer ``text`` to ``task`` as the result slot holds it.

        Args:
            task: The task asked.
            text: The answer as it came.
            warnings: The generation's own (``truncated_max_tokens``, ``truncated_repetition``).

        Returns:
            ``(answer, warnings)``: a string, or for ``extract`` a dict of every requested field.

        Raises:
            UnparsableOutput: the answer is not in the task's format (``raw`` keeps it).
        """
        if task.name == "extract":
            return parsers.parse_fields(text, tuple(task.params.fields or ()) if task.params else (), warnings)
        return parsers.parse_text(text, warnings)


def _dialects() -> dict[str, type[Dialect]]:
    from services.infer.engines.dialects.generic import GenericDialect
    from services.infer.engines.dialects.hunyuan import HunyuanDialect

    return {"hunyuan": HunyuanDialect, "generic": GenericDialect}


DIALECT_NAMES = ("hunyuan", "generic")
"""The dialects of this build (:func:`dialect` builds them)."""


def dialect(name: str, model: str = "") -> Dialect:
    """The dialect ``name``; ``auto``: ``hunyuan`` when ``model`` is named like HunyuanOCR, else ``generic``.

    Raises:
        ValueError: an unknown dialect.
    """
    name = resolve_dialect(name, model)
    cls = _dialects().get(name)
    if cls is None:
        raise ValueError(f"unknown dialect {name!r}: use auto, {', '.join(DIALECT_NAMES)}")
    return cls()


def task_output(d: Dialect, task: EngineTask, text: str, warnings: tuple[str, ...],
                started: float) -> EngineOutput | UnparsableOutput:
    """One image's answer to a task other than ``ocr``, read by dialect ``d`` (shared by the VLM
    engines): an :class:`EngineOutput` with ``answer`` set and no segments, or the
    :class:`UnparsableOutput` the parser raised (``raw``: the answer), returned, never raised.

    Args:
        started: ``time.perf_counter()`` when the image's request began (for ``inference_ms``).
    """
    try:
        answer, warnings = d.parse(task, text, warnings)
    except UnparsableOutput as exc:
        log.info("%s: answer to %s of %d characters is not in the task's format", d.name, task.name, len(text))
        exc.inference_ms = (time.perf_counter() - started) * 1000
        return exc
    return EngineOutput([], (time.perf_counter() - started) * 1000, warnings, answer=answer)
